"""Probe (GPU): how fast can Triton stream MXFP4 expert weights through tensor cores on this GPU?

One projection of the K3 expert shape (gate_up: N = 2I = 6144 rows, K = 3584), the weights of `experts`
distinct experts, each times M = 16 activation rows (one padded MMA tile of tokens), two ways:
  dot_scaled  tl.dot_scaled(W e2m1 + e8m0 scales, x^T bf16): Triton's own fp4 upcast + MMA
  manual      our decode (e2m1 bits -> fp16 -> bf16, times the e8m0 scale) + tl.dot
Reports ms and the fraction of the HBM floor (weights + scales bytes / 4.57 TB/s). Checks both against a
torch fp32 computation on decoded weights. Writes JSON to --out.

    python bench/mxfp4_dot_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from megadecode.measure import HBM_READ_BPS
from megadecode.kernels.common import e8m0_to_f32
from megadecode.quant.mxfp4 import dequantize_mxfp4


@triton.jit
def _decode_bf16(b, hi: tl.constexpr):
    if hi:
        bits = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    else:
        bits = ((b & 8) << 12) | ((b & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.bfloat16)


@triton.jit
def probe_kernel(w_ptr, s_ptr, x_ptr, ids_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    slot = tl.program_id(0)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M)
    acc = tl.zeros((BLOCK_N, M), dtype=tl.float32)
    w_base = w_ptr + e * (N * K // 2)
    s_base = s_ptr + e * (N * K // 32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_base + n[:, None] * (K // 2) + kb[None, :])
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_base + n[:, None] * (K // 32) + ks[None, :])
        if MODE == 0:
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + m[None, :] * K + k[:, None])  # [BLOCK_K, M] bf16
            acc = tl.dot_scaled(w, s, "e2m1", xt, None, "bf16", acc)
        else:
            b = w.to(tl.int32)
            sc = tl.reshape(tl.broadcast_to(e8m0_to_f32(s.to(tl.int32))[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                            (BLOCK_N, BLOCK_K // 2)) * 16384.0
            we = (_decode_bf16(b, False).to(tl.float32) * sc).to(tl.bfloat16)
            wo = (_decode_bf16(b, True).to(tl.float32) * sc).to(tl.bfloat16)
            ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            xe = tl.load(x_ptr + m[None, :] * K + ke[:, None])
            xo = tl.load(x_ptr + m[None, :] * K + ke[:, None] + 1)
            acc = tl.dot(we, xe, acc)
            acc = tl.dot(wo, xo, acc)
    tl.store(out_ptr + slot * N * M + m[None, :] * N + n[:, None], acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    E, N, K, M = 896, 6144, 3584, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (E, N, K // 2), device="cuda", dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 124, (E, N, K // 32), device="cuda", dtype=torch.uint8, generator=g)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    for experts in (16, 128, 512):
        ids = torch.randperm(E, device="cuda", generator=g)[:experts].contiguous()
        nbytes = experts * N * (K // 2 + K // 32)
        floor = nbytes / HBM_READ_BPS * 1e3
        ref = None
        if experts == 16:
            wf = dequantize_mxfp4(packed[ids], scales[ids])  # [16, N, K] fp32
            ref = torch.einsum("enk,mk->emn", wf, x.float())
        for mode, bn, bk, nw, ns in itertools.product((0, 1), (64, 128), (128, 256), (4, 8), (3, 4)):
            out = torch.full((experts, M, N), float("nan"), device="cuda")
            grid = (experts, N // bn)
            try:
                fn = lambda: probe_kernel[grid](packed, scales, x, ids, out, N=N, K=K, M=M, BLOCK_N=bn,  # noqa
                                                BLOCK_K=bk, MODE=mode, num_warps=nw, num_stages=ns)
                fn()
                torch.cuda.synchronize()
                err = None
                if ref is not None:
                    err = float((out - ref).abs().max() / ref.abs().max())
                ms = float(do_bench(fn))
            except Exception as ex:  # noqa: BLE001 (a probe: record and go on)
                rows.append({"experts": experts, "mode": mode, "BLOCK_N": bn, "BLOCK_K": bk, "warps": nw,
                             "stages": ns, "error": f"{type(ex).__name__}: {str(ex)[:160]}"})
                continue
            rows.append({"experts": experts, "mode": ["dot_scaled", "manual"][mode], "BLOCK_N": bn, "BLOCK_K": bk,
                         "warps": nw, "stages": ns, "ms": ms, "floor_ms": floor, "mbu": floor / ms, "err": err})
    json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)
    best = {}
    for r in rows:
        if "ms" in r:
            k = (r["experts"], r["mode"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    for r in rows:
        if "error" in r:
            print("ERR", r)
            break
    for (ex, mode), r in sorted(best.items()):
        print(f"experts {ex:>4} {mode:<10} best {r['ms']:.4f} ms floor {r['floor_ms']:.4f} MBU {r['mbu']:.1%} "
              f"err {r['err']} cfg BN{r['BLOCK_N']} BK{r['BLOCK_K']} w{r['warps']} s{r['stages']}")


if __name__ == "__main__":
    main()
