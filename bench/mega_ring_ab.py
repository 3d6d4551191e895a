"""The megakernel's two builds against each other at batch 1, by launch time on the GPU: the weight ring's build
(one CTA an SM, the loader warp streaming the staged MATVEC rows; cute/base.py) on a program with its rows staged
(`ring`) and without (`noring`: the same build, the rows read from global memory as the other build reads them),
and the other build (two CTAs an SM: `plain<CTAs>`), interleaved in rounds (one launch of each a round, CUDA
events around each; bench/mega_sync_ab.interleaved), after each build's check against pyvm (--check
preset:batch:ctas, delayed launches included; validate.mega_gpu.diff_program). At batch 1 a timeline of the ring
and the plain build: per opcode (MATVEC per weight) the mean instruction time, its wait and the body's marks.
Past batch 1 only the plain build runs (runtime.ring_build). JSON to --out.

    python bench/mega_ring_ab.py --check tiny-qwen3-moe:1:16,tiny-qwen3-moe:1:5,tiny-qwen3-moe:3:16 \\
        --preset qwen3-30b-a3b --batch 1,8 --out $OUT/mega-ring-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import default_ctas, frag_order
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.program import Program
from megadecode.backends.mega.runtime import MegaRuntime
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.weights import random_weights
from mega_sync_ab import interleaved  # bench/


def runtime(prog: Program, batch: int, context: int, ring: bool, stage: str = "all", **kw) -> MegaRuntime:
    """A warmed runtime of `prog` on the build `ring`; stage "none": its rows not staged (Program.stageable off)."""
    saved = Program.stageable
    if stage == "none":
        Program.stageable = lambda self, ins: False
    try:
        rt = MegaRuntime(prog, "cuda", ring=ring, **kw)
    finally:
        Program.stageable = saved
    rt.view("tokens").copy_(torch.arange(batch))
    rt.view("positions").fill_(context)
    rt.view("slots").copy_(torch.arange(batch))
    for _ in range(3):
        rt.launch()
    torch.cuda.synchronize()
    rt.check()
    return rt


def op_means(rt: MegaRuntime) -> dict:
    """One timeline launch: per opcode (MATVEC per weight) the mean instruction time from its wait's end, the mean
    wait and the mean of each body mark (us from the instruction's start); the step's span."""
    rt.launch()
    torch.cuda.synchronize()
    rt.check()
    rows = rt.timeline_rows()
    by: dict[str, list] = {}
    for r in rows:
        key = r["op"] + ("." + r["name"].split(".")[1].split("[")[0] if r["op"] == "MATVEC" else "")
        by.setdefault(key, []).append(((r["end"] - r["start"]) / 1e3, (r["start"] - r["wait"]) / 1e3,
                                       [(m - r["start"]) / 1e3 if m is not None else None for m in r["marks"]]))

    def mark(v, i):
        xs = [m[i] for _, _, m in v if m[i] is not None]
        return round(statistics.mean(xs), 2) if xs else None

    return {"step_us": (max(r["end"] for r in rows) - min(r["wait"] for r in rows)) / 1e3,
            "ops": {k: {"n": len(v), "work_us": statistics.mean(x for x, _, _ in v),
                        "wait_us": statistics.mean(y for _, y, _ in v), "marks_us": [mark(v, i) for i in range(4)]}
                    for k, v in sorted(by.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", default="tiny-qwen3-moe:1:16,tiny-qwen3-moe:1:5,tiny-qwen3-moe:3:16",
                    help="preset:batch:ctas cases each build is diffed against pyvm at first")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="mega-ring-ab.json")
    a = ap.parse_args(argv)
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"), "checks": [],
           "runs": []}

    def save():
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    from megadecode.validate.mega_gpu import diff_failures, diff_program

    for spec in filter(None, a.check.split(",")):
        preset, b, ctas = spec.split(":")
        r = diff_program(preset, int(b), int(ctas), seed=int(b))
        worst = max((x.get("rel", 0.0) for x in r.get("buffers", [])), default=None)
        out["checks"].append({"preset": preset, "batch": int(b), "ctas": int(ctas), "failures": diff_failures(r),
                              "worst_rel": worst})
        print(f"check {spec}: {diff_failures(r) or 'pass'} (worst rel {worst})", flush=True)
        save()
    dev = torch.device("cuda")
    for preset in a.preset.split(","):
        cfg = preset_config(preset)
        w = random_weights(cfg, "cuda", torch.bfloat16, 0)
        w = expert_layout.take(w, build_plan(cfg), frag_order(cfg, "cuda"))
        for batch in map(int, a.batch.split(",")):
            cache = KVCache(cfg, batch, a.context + 8, "cuda", torch.bfloat16)
            for parts in cache.layers.values():
                for t in parts:
                    t.normal_()
            rc, pc = default_ctas(dev, True), default_ctas(dev, False)
            pp = schedule(lower(cfg, w, cache, batch, pc), pc)
            rts = {}
            if batch == 1:
                rp = schedule(lower(cfg, w, cache, batch, rc), rc)
                rts["ring"] = runtime(rp, batch, a.context, True)
                rts["noring"] = runtime(rp, batch, a.context, True, stage="none")
            rts[f"plain{pc}"] = runtime(pp, batch, a.context, False)
            med, mins = interleaved(rts, a.rounds)
            r = {"preset": preset, "batch": batch, "context": a.context, "ctas": {"ring": rc, "plain": pc},
                 "rounds": a.rounds, "median_us": med, "min_us": mins, "timeline": {}}
            print(f"{preset} b={batch}: " + "  ".join(f"{n} {v:.0f} us" for n, v in med.items()), flush=True)
            del rts
            if batch == 1:
                r["timeline"]["ring"] = op_means(runtime(rp, batch, a.context, True, timeline=True))
                r["timeline"]["plain"] = op_means(runtime(pp, batch, a.context, False, timeline=True))
            out["runs"].append(r)
            save()
            del cache
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    print(f"wrote {a.out}")
    return 0 if all(not c["failures"] for c in out["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
