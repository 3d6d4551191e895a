"""The megakernel: one persistent GPU launch per decode step, and its golden model.

    isa.py        instructions: opcodes, arguments, fixed-width int32 rows, counters with per-launch targets
    program.py    a lowered step: instructions, the tensor table, the activation arenas, the CTA queues
    lower.py      decode plan (qwen3_moe, deepseek_v3) -> instructions, ops split into tiles
    schedule.py   instructions -> per-CTA queues by a cost model (bytes, flops); a printable report
    pyvm.py       the golden model: the same instructions interpreted with torch, waits asserted, races found
    cute_kernel.py  the persistent kernel in CuTe DSL (the `cute` extra), compiled on first use
"""
