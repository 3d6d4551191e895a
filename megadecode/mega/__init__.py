"""The megakernel: one persistent GPU launch per decode step, and its golden model.

    isa.py        instructions: opcodes, arguments, fixed-width int32 rows, counters with per-launch targets
    program.py    a lowered step: instructions, the tensor table, the activation arenas, the CTA queues
    lower.py      decode plan (qwen3_moe, deepseek_v3, kimi_k3) -> instructions, ops split into tiles
    schedule.py   instructions -> per-CTA queues by a cost model (bytes, flops); a printable report
    pyvm.py       the golden model: the same instructions interpreted with torch, waits asserted, races found
    cute_kernel.py  the persistent kernel in CuTe DSL (the `cute` extra), compiled on first use; qwen3_moe and
                  deepseek_v3's opcodes (kimi_k3's ATTN_RES, KDA_STEP and MXFP4 experts: pyvm only so far)
    runtime.py    its device buffers, one compile per process, co-residency, the error buffer
"""
