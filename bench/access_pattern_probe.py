"""Does the bf16 experts' access pattern stream slower from the HBM than the same bytes read in contiguous blocks?

The megakernel's F_GROUP expert loop (mega/cute/moe.py group_units over dense.py tc_step) has each warp read, per
step, 16 rows x 64 bytes of a row-major [rows, K] weight (rows K x 2 bytes apart), and the step after it the next
64 bytes of the same rows. This probe times a Triton kernel of one warp a program reading a [16, BK] tile a step in
that order (`strided`) against one reading the same bytes laid out so that each step's tile is one contiguous block
(`tiled`: the weight as [rows / 16, K / BK, 16, BK]), both over a matrix far larger than L2, with one matrix or two
(EXPERT_UP's gate and up rows) a step. If `tiled` is much faster, a re-layout of the experts (as quant/mxfp4_frag.py
does for K3's MXFP4 experts) is worth its plumbing; if not, the loop's waits are its bytes in flight.

    python bench/access_pattern_probe.py --out bench/results/access-pattern-probe-<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def strided(w, u, out, K: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * 16 + tl.arange(0, 16)
    c = tl.arange(0, BK)
    acc = tl.zeros([16, BK], tl.float32)
    for k in range(0, K, BK):
        p = r[:, None] * K + k + c[None, :]
        acc += tl.load(w + p).to(tl.float32)
        if TWO:
            acc += tl.load(u + p).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def tiled(w, u, out, K: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.arange(0, 16)[:, None] * BK + tl.arange(0, BK)[None, :]
    acc = tl.zeros([16, BK], tl.float32)
    base = pid * 16 * K
    for k in range(0, K, BK):
        p = base + k * 16 + i
        acc += tl.load(w + p).to(tl.float32)
        if TWO:
            acc += tl.load(u + p).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def time_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2048, help="the weight's row length (qwen3-30b-a3b's hidden size)")
    ap.add_argument("--rows", type=int, default=96 * 1024, help="rows of each matrix (a multiple of 16)")
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("access_pattern_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.rows % 16 or a.k % 256:
        print("access_pattern_probe: --rows must be a multiple of 16 and --k of 256", file=sys.stderr)
        return 2
    w = torch.randn(a.rows, a.k, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(a.rows, a.k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(a.rows // 16, device="cuda")
    rows = []
    for two in (False, True):
        for bk in (64, 128, 256):
            for name, kern in (("strided", strided), ("tiled", tiled)):
                us = time_us(lambda: kern[(a.rows // 16,)](w, u, out, K=a.k, BK=bk, TWO=two, num_warps=1))
                nbytes = (2 if two else 1) * a.rows * a.k * 2
                rows.append({"pattern": name, "bk": bk, "matrices": 2 if two else 1, "us": round(us, 1),
                             "gb_per_s": round(nbytes / us / 1e3, 1)})
                print(f"{name:8s} BK={bk:3d} matrices={rows[-1]['matrices']} {us:9.1f} us "
                      f"{rows[-1]['gb_per_s']:7.0f} GB/s", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "k": a.k, "rows": a.rows,
                                           "command": " ".join(["python", "bench/access_pattern_probe.py",
                                                                *(argv or sys.argv[1:])]),
                                           "rows_timed": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
