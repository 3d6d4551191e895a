"""Does an instruction of the megakernel pay for its code arriving? A probe on the GPU: the shipped program of
--preset at --batch, where each instruction of the --ops opcodes gets a copy that runs just before it on the same
CTA (the same waits, no signal, the same outputs written with the same values: ROUTE's tables, MERGE's rows, ...),
recorded with the timeline. The copy runs the opcode's code first on that CTA since the last time some other body
evicted it; the original runs it again straight after, its code warm in the SM's instruction caches, its data
where the copy left it (activations re-read from L2 after the original's acquire, as the copy read them). The
difference of their work spans is what the first run of the code costs.

Why the question: the kernel's SASS is ~600 KB (38,656 instructions for sm_90a at 1e8d862), far past an SM's
instruction caches, and a layer walks ~8 bodies in turn, each once per CTA; short bodies cost far more than their
memory trips explain (qwen3-30b-a3b batch 1 at d581af0: ROUTE 9.7 us for one logit row's softmax and 8 picks;
MERGE 3.4 us; docs/megakernel.md).

    python bench/mega_icache_probe.py --preset qwen3-30b-a3b --batch 1 --ops ROUTE,MERGE,EMBED --out probe.json

Only opcodes whose outputs are plain stores are accepted (a copy of an in-place add, F_RESID or EXPERT_DOWN's
combine, would add twice).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

import torch

from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import default_ctas, frag_order
from megadecode.backends.mega.isa import F_RESID
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.weights import random_weights
from mega_timeline import _runtime  # bench/: one step's inputs set, compiled and warmed

SAFE = ("ROUTE", "MERGE", "EMBED", "ATTN_GQA", "MATVEC", "GLU")  # plain stores (MATVEC / GLU without F_RESID)
COPY = "~first"


def with_copies(prog, ops: set[str]):
    """prog with a signal-free copy of each instruction of `ops` queued just before it on its CTA."""
    instrs = list(prog.instrs)
    queues = []
    for q in prog.queues:
        nq = []
        for i in q:
            ins = instrs[i]
            if ins.op in ops and not (ins.op in ("MATVEC", "GLU") and ins.flags & F_RESID):
                instrs.append(replace(ins, signal=-1, name=ins.name + COPY, waits=list(ins.waits)))
                nq.append(len(instrs) - 1)
            nq.append(i)
        queues.append(nq)
    return replace(prog, instrs=instrs, queues=queues)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ops", default="ROUTE,MERGE,EMBED")
    ap.add_argument("--out", default="mega-icache-probe.json")
    args = ap.parse_args(argv)
    ops = set(args.ops.split(","))
    if ops - set(SAFE):
        ap.error(f"--ops {sorted(ops - set(SAFE))}: a copy would not write the same values (plain stores only: "
                 f"{', '.join(SAFE)})")
    cfg = preset_config(args.preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))
    cache = KVCache(cfg, args.batch, args.context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ctas = default_ctas(torch.device("cuda"))
    prog = with_copies(schedule(lower(cfg, w, cache, args.batch, ctas), ctas), ops)
    rt = _runtime(prog, args.batch, args.context, timeline=True)
    rt.launch()
    torch.cuda.synchronize()
    rt.check()
    rows = rt.timeline_rows()
    span = {r["name"]: (r["end"] - r["start"]) / 1e3 for r in rows}
    marks = {r["name"]: [None if m is None else (m - r["start"]) / 1e3 for m in r["marks"]] for r in rows}
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"),
           "preset": args.preset, "batch": args.batch, "context": args.context, "ctas": ctas, "by_op": {}}
    op_of = {x.name: x.op for x in prog.instrs}

    def med_marks(names):
        return [statistics.median(v) if (v := [marks[n][i] for n in names if marks[n][i] is not None]) else None
                for i in range(4)]

    for op in sorted(ops):
        names = [n for n in span if not n.endswith(COPY) and n + COPY in span and op_of[n] == op]
        if not names:
            continue
        first = [span[n + COPY] for n in names]
        again = [span[n] for n in names]
        saved = statistics.median(span[n + COPY] - span[n] for n in names)
        out["by_op"][op] = {"pairs": len(names), "first_us_median": statistics.median(first),
                            "again_us_median": statistics.median(again), "saved_us_median": saved,
                            "marks_first_us": med_marks([n + COPY for n in names]),
                            "marks_again_us": med_marks(names)}
        print(f"{op:12s} {len(names):5d} pairs: first run {statistics.median(first):6.2f} us, again "
              f"{statistics.median(again):6.2f} us (median of the differences {saved:.2f} us); marks first "
              f"{out['by_op'][op]['marks_first_us']}, again {out['by_op'][op]['marks_again_us']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
