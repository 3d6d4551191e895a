"""Per-row decode error of each executor against fp32 torch on the CPU (same bf16-valued weights), 4 prompts of
different lengths: finds which executor, which row and which step go wrong. Diagnostic, not a benchmark."""
import sys

import torch

from megadecode.engine import Engine
from megadecode.presets import preset_config
from megadecode.weights import random_weights

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 40, 41]]


def run(preset, executors, steps=6, init="cpu"):
    cfg = preset_config(preset)
    w16 = {k: v.cpu() for k, v in random_weights(cfg, init, torch.bfloat16, seed=1).items()}
    oracle = Engine(cfg, {k: v.float() for k, v in w16.items()}, executor="torch", max_batch=8, max_seq_len=128)
    toks = [oracle.prefill(PROMPTS).argmax(-1)]
    ref = []
    for _ in range(steps):
        ref.append(oracle.decode(toks[-1]).float())
        toks.append(ref[-1].argmax(-1))
    print(f"weights made on {init}")
    tb = None
    for ex, dt in executors:
        w = {k: v.to("cuda", dt) for k, v in w16.items()}
        try:
            e = Engine(cfg, w, executor=ex, max_batch=8, max_seq_len=128)
            e.prefill(PROMPTS)
            rows, outs = [], []
            for i in range(steps):
                b = e.decode(toks[i].cuda()).float().cpu()
                outs.append(b)
                rows.append(((ref[i] - b).abs().amax(-1) / ref[i].abs().max()).tolist())
            if ex == "torch" and dt == torch.bfloat16:
                tb = outs
            elif tb is not None and dt == torch.bfloat16:
                vt = max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(tb, outs))
                print(f"   {ex} vs torch bf16: worst {vt:.2e}")
            worst = [max(r[j] for r in rows) for j in range(4)]
            first = [next((i for i, r in enumerate(rows) if r[j] > 0.05), None) for j in range(4)]
            print(f"{preset:18s} {ex:9s} {str(dt)[6:]:9s} worst/row {['%.1e' % x for x in worst]} first>5% {first}",
                  flush=True)
        except Exception as err:  # noqa: BLE001
            print(f"{preset:18s} {ex:9s} {str(dt)[6:]:9s} ERROR {type(err).__name__}: {str(err)[:200]}", flush=True)


if __name__ == "__main__":
    import os
    os.environ.setdefault("MEGADECODE_MEGA_UNVALIDATED", "1")
    for p in sys.argv[1].split(","):
        exs = [(x, getattr(torch, d)) for x in sys.argv[2].split(",") for d in sys.argv[3].split(",")]
        run(p, exs, init=sys.argv[4] if len(sys.argv) > 4 else "cpu")
