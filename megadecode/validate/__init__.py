"""The fast-track validation harness: checks that every variant of plan ops keeps the op contract
(megadecode.contract) and computes what the torch reference computes, and the matrix that runs them
(`megadecode validate`). It sits on top of the package: nothing in serving imports it.

    executor.py  VariantExecutor: the plan with some ops replaced by variants, manifests enforced
    inputs.py    fresh random inputs per op kind and routing distribution
    tolerances.py  the per-dtype tolerance table (data)
    checks.py    per-op checks (poison, determinism, inputs untouched, reference, batch invariance)
    gpu_checks.py  on CUDA: CUDA-graph replay on fresh inputs, concurrent two-stream runs
    e2e.py       greedy end-to-end comparison with the torch executor
    matrix.py    ops x presets x batches x dtypes x distributions x seeds -> PASS/FAIL/SKIP rows
    catalog.py   every variant the harness knows (the shipped kernels, torch_variants, broken); get / all_variants
    torch_variants.py  plain-torch restatements (sync-free grouped experts, reference GQA) as variants
    broken.py    deliberately broken variants (`broken-*`), which the harness must flag
    handoff.py   a persistent producer/consumer Triton kernel with planted ordering bugs (the ordering audit)
    audit.py     static sm_90 PTX/SASS audit of Triton kernels (coherence, acquire/release)
    ordering.py  the ordering audit: static + GPU random-delay runs over the handoff kernel's planted bugs
    perf.py      a variant's op timed against the reference op (GPU)
    report.py    the HTML evidence report and its markdown summary
    command.py   `megadecode validate`
"""
