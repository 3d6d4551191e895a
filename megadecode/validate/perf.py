"""A variant's speed against the torch reference op it replaces, on the GPU (for evidence reports).

Each replaced op kind is timed at the real qwen3-30b-a3b dimensions (the deepseek-style router at
tiny-deepseek-v3's routing rules is not timed: its dims are CPU-sized), bf16, batches 1, 8, 64, with
`triton.testing.do_bench` (median, CUDA events). The op's outputs are preallocated once.
"""

from __future__ import annotations

import torch

from ..contract import Variant, output_specs
from ..backends.torch.ops import OP_IMPLS, StepContext
from ..presets import preset_config
from .inputs import build_case


def time_against_reference(v: Variant, preset: str = "qwen3-30b-a3b", batches=(1, 8, 64)) -> list[dict]:
    from triton.testing import do_bench

    cfg = preset_config(preset)
    rows = []
    for kind in v.manifest.replaces:
        for batch in batches:
            if v.supports(cfg, torch.bfloat16, batch, "cuda") is not None:
                continue
            case = build_case(cfg, kind, batch, seed=0, device="cuda").clone(torch.bfloat16)
            specs = output_specs(cfg, case.op, dict(case.inputs), case.weights)
            outs = {n: torch.empty(shape, dtype=dt, device="cuda") for n, (shape, dt) in specs.items()}

            def run_variant():
                v.run(case.op, case.inputs, case.weights, outs, cfg, case.step, case.cache)

            def run_reference():
                ctx = StepContext(cfg, case.weights, {case.op.cache: case.cache} if case.op.cache else {}, case.step)
                ctx.buf.update(case.inputs)
                OP_IMPLS[case.op.kind](ctx, case.op)

            t_var, t_ref = do_bench(run_variant), do_bench(run_reference)
            rows.append({"op": kind, "preset": preset, "dtype": "bfloat16", "batch": batch,
                         "variant_us": round(t_var * 1e3, 2), "reference_us": round(t_ref * 1e3, 2),
                         "speedup": round(t_ref / t_var, 2)})
    return rows
