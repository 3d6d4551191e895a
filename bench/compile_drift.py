"""Where does the whole-step `torch.compile` drift from the eager step? Runs one decode step of a preset
(bf16, random weights, CPU or CUDA) eagerly and compiled, records every op's first output, and prints
the max abs difference per op (routing ids included), so a reviewer sees whether a mismatch is ulp drift
plus a routing flip or a wrong op. Usage: python bench/compile_drift.py --preset tiny-deepseek-v3
"""

from __future__ import annotations

import argparse

import torch

from megadecode.engine import Engine
from megadecode.presets import preset_config
from megadecode.step import Step
from megadecode.weights import random_weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-deepseek-v3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    cfg = preset_config(a.preset)
    eng = Engine(cfg, random_weights(cfg, a.device, torch.bfloat16, 0), executor="graph", max_batch=4,
                 max_seq_len=64)
    eng.prefill([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]])
    slots = torch.arange(4, device=a.device)
    step = Step(tokens=torch.tensor([1, 2, 3, 4], device=a.device), positions=torch.tensor(eng.lengths, device=a.device),
                slots=slots, logit_rows=slots, kv_len=max(eng.lengths) + 1, contiguous_slots=True)
    snap = {k: tuple(t.clone() for t in v) for k, v in eng.cache.layers.items()}

    def trace(st):
        outs = []
        eng.executor.run_ops(st, hook=lambda op, ctx: outs.append(ctx.buf[op.outputs[0]].float() * 1))
        return outs

    eager = trace(step)
    for k, v in eng.cache.layers.items():  # the step wrote the cache: put it back before the second run
        for t, s in zip(v, snap[k]):
            t.copy_(s)
    compiled = torch.compile(trace, dynamic=False)(step)
    for op, x, y in zip(eng.plan.ops, eager, compiled):
        print(f"{op.name:40s} max|eager - compiled| {(x - y).abs().max().item():.4g}  (max|eager| {x.abs().max().item():.3g})")


if __name__ == "__main__":
    main()
