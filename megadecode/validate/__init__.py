"""The fast-track validation harness: checks that every variant of plan ops keeps the op contract
(megadecode.contract) and computes what the torch reference computes, and the matrix that runs them
(`megadecode validate`). It sits on top of the package: nothing in serving imports it.

    executor.py  VariantExecutor: the plan with some ops replaced by variants, manifests enforced
    inputs.py    fresh random inputs for every op kind: routing distributions, cache length, slots, magnitudes
    cases.py     extra cases from the variant's scope: odd dims, tile edges, scope edges, long caches, permuted
                 slots, tiny/large rows; seeded samples
    tolerances.py  tolerances derived per check from the reference's own error in the dtype under test
    checks.py    per-op checks (poison and guards, computed NaN, declared launches, determinism, inputs untouched,
                 reference, batch invariance)
    guards.py    guard regions around each output
    launches.py  the Triton launches a variant makes, against its declared kernels
    gpu_checks.py  on CUDA: graph replay on fresh inputs, two streams, repeats under load, launch order
    e2e.py       greedy end-to-end comparison with the torch executor
    matrix.py    ops x presets x batches x dtypes x distributions x seeds (+ extra cases) -> PASS/FAIL/SKIP rows
    catalog.py   every variant the harness knows (the shipped kernels, torch_variants, broken); get / all_variants
    torch_variants.py  plain-torch restatements (grouped experts, GQA, embedding, add, MLP, AttnRes) as variants
    broken.py    deliberately broken variants (`broken-*`), which the harness must flag; broken_kernels.py: the
                 RMSNorm kernel with planted mistakes
    handoff.py   a persistent producer/consumer Triton kernel with planted ordering bugs (the ordering audit)
    audit.py     static sm_90 PTX/SASS audit of a compiled kernel (coherence, acquire/release)
    kernel_audit.py  the audit of every kernel a variant declares, cached, in a fresh process when interpreted
    ordering.py  the ordering audit: static + GPU random-delay runs over the handoff kernel's planted bugs
    perf.py      a variant's op timed against the reference op (GPU)
    report.py    the HTML evidence report and its markdown summary (report_plots.py: per-dtype error plots)
    staleness.py which evidence reports predate a change of what they depend on
    mega_audit.py  the static audit of the CuTe megakernel; mega_gpu.py: the megakernel against pyvm and torch on a
                 GPU (every buffer, repeats and delayed runs bitwise, greedy generation; bench/mega_check.py)
    command.py   `megadecode validate`
"""
