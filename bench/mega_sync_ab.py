"""The megakernel's synchronisation steps against alternatives, by launch time on the GPU. Each variant is a build
of the kernel with one of cute_kernel.py's module-level synchronisation steps swapped for one compile (the way
validate/mega_plants.py swaps in its planted mistakes; the shipped source holds no switch), each alternative a
correct one under the PTX memory model, and each first checked against pyvm (validate.mega_gpu.diff_program on
tiny-qwen3-moe at batch 1 and 3, delayed launches included). Then per preset and batch every variant's launch is
timed in interleaved rounds (one launch of each variant a round, CUDA events around each), so that the GPU's drift
within the call falls on all of them alike; the medians are written to --out as JSON.

    python bench/mega_sync_ab.py --preset qwen3-30b-a3b,k3-mini --batch 1,8 --out $OUT/mega-sync-ab.json

Variants (what the issue-40 measurements ask of an instruction's fixed costs: ~1.0-1.5 us from a body's last mark to
its end, the barrier and the signal, and the wait before every instruction):
- `shipped`: the wait polls with `ld.acquire.gpu` (each poll invalidates the SM's L1, under the co-resident CTA's
  loads too); the signal is `fence.acq_rel.gpu` then `atom.add.release.gpu`.
- `relaxed_poll`: one acquire load; while the counter is short, relaxed polls (no L1 invalidation), then one
  acquire load once it reached the target (the acquire reads a value at or past the target: it synchronises with
  the releases that produced it).
- `release_only`: the signal's release add without the fence before it (the add's release semantics order the
  block barrier's prior stores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

from megadecode.backends.mega.executor import default_ctas
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.runtime import compile_launcher
from megadecode.backends.mega.schedule import schedule
from megadecode.cache import KVCache
from megadecode.presets import preset_config
from megadecode.validate.mega_gpu import diff_failures, diff_program
from megadecode.weights import random_weights
from mega_timeline import _runtime  # bench/: one step's inputs set, compiled and warmed, as the timelines take it

VARIANTS = ("shipped", "relaxed_poll", "release_only")


def _swaps(name: str) -> list[tuple[object, str, object]]:
    import cutlass.cute as cute
    from cutlass import Int32

    from megadecode.backends.mega import cute_kernel as K

    acquire = K.wait_load

    @cute.jit
    def wait_counter_relaxed_poll(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32,
                                  epoch: Int32, max_spin: Int32, instr: Int32) -> Int32:
        ok = Int32(1)
        if c_idx >= 0:
            target = (epoch - 1) * per + need
            p = (ctr.iterator + c_idx).llvm_ptr
            v = acquire(p)
            if (v - target) < 0:
                spins = Int32(0)
                aborted = Int32(0)
                while (v - target) < 0 and spins < max_spin and aborted == 0:
                    v = cute.arch.load(p, Int32, sem="relaxed", scope="gpu")
                    aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
                    spins += 1
                v = acquire(p)
            if (v - target) < 0:
                ok = Int32(0)
                old = cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed",
                                           scope="gpu")
                if old == 0:
                    err[1] = instr
                    err[2] = c_idx
                    err[3] = v
                    err[4] = target
        return ok

    @cute.jit
    def signal_release_only(ctr: cute.Tensor, sig: Int32):
        cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="release", scope="gpu")

    return {"shipped": [], "relaxed_poll": [(K, "wait_counter", wait_counter_relaxed_poll)],
            "release_only": [(K, "signal", signal_release_only)]}[name]


@contextlib.contextmanager
def _swapped(name: str):
    swaps = _swaps(name)
    saved = [(m, a, getattr(m, a)) for m, a, _ in swaps]
    try:
        for m, a, new in swaps:
            setattr(m, a, new)
        yield
    finally:
        for m, a, old in reversed(saved):
            setattr(m, a, old)


def build(name: str, device):
    with _swapped(name):
        return compile_launcher(device, cache=False)


def timed(preset: str, batch: int, context: int, kernels: dict, rounds: int) -> dict:
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    cache = KVCache(cfg, batch, context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ctas = default_ctas(torch.device("cuda"))
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    rts = {n: _runtime(prog, batch, context, kernel=k) for n, k in kernels.items()}
    ts = {n: [] for n in rts}
    for _ in range(rounds):
        for n, rt in rts.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            rt.launch()
            b.record()
            b.synchronize()
            ts[n].append(a.elapsed_time(b) * 1e3)
    for rt in rts.values():
        rt.check()
    med = {n: sorted(v)[len(v) // 2] for n, v in ts.items()}
    del rts, prog, cache, w
    torch.cuda.empty_cache()
    return {"preset": preset, "batch": batch, "context": context, "ctas": ctas, "rounds": rounds,
            "median_us": med, "min_us": {n: min(v) for n, v in ts.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b,k3-mini")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="mega-sync-ab.json")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: {', '.join(VARIANTS)}")
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"), "compile_s": {},
           "checks": [], "runs": []}
    kernels = {}
    for n in names:
        t0 = time.perf_counter()
        kernels[n] = build(n, dev)
        out["compile_s"][n] = round(time.perf_counter() - t0, 1)
        for b in (1, 3):  # correct first: every buffer against pyvm, repeats and delayed launches bitwise equal
            r = diff_program("tiny-qwen3-moe", b, 16, seed=b, kernel=kernels[n])
            out["checks"].append({"variant": n, "batch": b, "failures": diff_failures(r)})
            print(f"check {n} b={b}: {diff_failures(r) or 'pass'}", flush=True)
    for p in args.preset.split(","):
        for b in map(int, args.batch.split(",")):
            r = timed(p, b, args.context, kernels, args.rounds)
            out["runs"].append(r)
            print(f"{p} b={b}: " + "  ".join(f"{n} {v:.0f} us" for n, v in r["median_us"].items()), flush=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
