"""A per-SM timeline of one megakernel decode step: which instruction each CTA ran when, and how long it waited.

Runs one step of `--preset` at `--batch` with the timeline build (MegaRuntime(timeline=True)), writes the rows as
JSON and renders a PNG: one row per SM, each instruction a bar coloured by opcode from its work start to its end,
the wait before it in grey. Random weights, cache filled with random values, every sequence `--context` long.

    python bench/mega_timeline.py --preset qwen3-30b-a3b --batch 1 --out $OUT/mega-timeline
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from megadecode.cache import KVCache
from megadecode.executors.mega_executor import default_ctas
from megadecode.mega.lower import lower
from megadecode.mega.runtime import MegaRuntime
from megadecode.mega.schedule import schedule
from megadecode.presets import preset_config
from megadecode.weights import random_weights


def render(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    colours = {op: plt.cm.tab20(i % 20) for i, op in enumerate(ops)}
    sms = sorted({r["sm"] for r in rows})
    fig, ax = plt.subplots(figsize=(16, max(4, len(sms) * 0.06)))
    for r in rows:
        y = sms.index(r["sm"])
        ax.barh(y, (r["start"] - r["wait"]) / 1e3, left=r["wait"] / 1e3, height=0.8, color="0.85", linewidth=0)
        ax.barh(y, (r["end"] - r["start"]) / 1e3, left=r["start"] / 1e3, height=0.8, color=colours[r["op"]],
                linewidth=0)
    ax.set_xlabel("us since the first wait")
    ax.set_ylabel("SM")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[o]) for o in ops] +
              [plt.Rectangle((0, 0), 1, 1, color="0.85")], labels=ops + ["waiting"], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="mega-timeline")
    args = ap.parse_args()
    cfg = preset_config(args.preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    cache = KVCache(cfg, args.batch, args.context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ctas = default_ctas(torch.device("cuda"))
    prog = schedule(lower(cfg, w, cache, args.batch, ctas), ctas)
    rt = MegaRuntime(prog, "cuda", timeline=True)
    rt.view("tokens").copy_(torch.arange(args.batch))
    rt.view("positions").fill_(args.context)
    rt.view("slots").copy_(torch.arange(args.batch))
    for _ in range(3):  # compile, warm
        rt.launch()
    torch.cuda.synchronize()
    rt.check()
    rows = rt.timeline_rows()
    step_us = max(r["end"] for r in rows) / 1e3
    busy = Counter()
    for r in rows:
        busy[r["op"]] += r["end"] - r["start"]
    summary = {"preset": args.preset, "batch": args.batch, "context": args.context, "ctas": ctas,
               "instructions": len(rows), "step_us": step_us,
               "work_us_by_op": {k: v / 1e3 for k, v in busy.most_common()},
               "wait_us_total": sum(r["start"] - r["wait"] for r in rows) / 1e3}
    with open(args.out + ".json", "w") as f:
        json.dump({"summary": summary, "rows": rows}, f)
    render(rows, args.out + ".png", f"{args.preset} batch {args.batch}: one megakernel step, {step_us:.0f} us")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
