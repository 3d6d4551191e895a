"""The fast-track validation harness: variants of plan ops, their manifests, checks against the torch
reference, and the matrix that runs them (`megadecode validate`).

    variant.py   Manifest/Scope, Variant (the in-place op contract), the registry
    executor.py  VariantExecutor: the plan with some ops replaced by variants, manifests enforced
    inputs.py    fresh random inputs per op kind and routing distribution
    tolerances.py  the per-dtype tolerance table (data)
    checks.py    per-op checks (poison, determinism, inputs untouched, reference, batch invariance)
    gpu_checks.py  on CUDA: CUDA-graph replay on fresh inputs, concurrent two-stream runs
    shapes.py    output shapes/dtypes of each op kind (to preallocate and poison them)
    e2e.py       greedy end-to-end comparison with the torch executor
    matrix.py    ops x presets x batches x dtypes x distributions x seeds -> PASS/FAIL/SKIP rows
    broken.py    deliberately broken variants (`broken-*`), which the harness must flag
    catalog.py   imports every shipped variant so the registry is complete
    audit.py     static sm_90 PTX/SASS audit of Triton kernels (coherence, acquire/release)
    ordering.py  the ordering audit: static + GPU random-delay runs over the handoff kernel's planted bugs
    perf.py      a variant's op timed against the reference op (GPU)
    report.py    the HTML evidence report and its markdown summary
    command.py   `megadecode validate`
"""
