"""The `mega` backend: one persistent GPU launch per decode step (the `mega` executor), and its golden model (the
`pyvm` executor).

    isa.py        instructions: opcodes, arguments, fixed-width int32 rows, counters with per-launch targets
    program.py    a lowered step: instructions, the tensor table, the activation arenas, the CTA queues
    lower.py      decode plan (qwen3_moe, deepseek_v3, kimi_k3) -> instructions: which plans lower, the checks
    builder.py    the instruction builder: arenas, tensor table, counters, ops split into tiles
    layers.py     one decoder layer at a time (GQA, MLA, KDA, AttnRes, dense MLP, routed and LatentMoE experts)
    schedule.py   instructions -> per-CTA queues by a cost model (bytes, flops); a printable report
    ops/          one module per opcode: what the kernel reads each argument as, what else its body assumes
                  (checked before a launch), which CuTe body runs it, and its semantics in pyvm (the
                  specification the kernel implements)
    pyvm.py       the golden model: the same instructions interpreted with torch, waits asserted, races found;
                  pyvm_ops.py the helpers the opcodes' semantics share
    cute_kernel.py  the persistent kernel in CuTe DSL (the `cute` extra), compiled on first use: the queue
                  loop, the counter waits and signals, dispatch to the opcode bodies
    cute/         the opcode bodies: base.py (the bodies' constants, MXFP4 decode, argument access; the generic
                  helpers are ../cute_device.py's), dense.py, attention.py, moe.py, k3.py (ATTN_RES, KDA_STEP)
    kernel_check.py what the kernel assumes of a program (dtypes, loop lengths, alignment: ops/' tables, then each
                  opcode's check), checked before a launch; limits.py the CTA's threads and shared memory, for both
    runtime.py    its device buffers, one compile per process, co-residency, the error buffer
    kernel_cache.py the compiled kernel on disk (exported once, loaded by later processes)
    spec.py       the kernel's declaration for the static audit (parameter roles, address tables)
    executor.py   the `mega` executor; pyvm_executor.py the `pyvm` executor (prefill: the torch reference)
"""
