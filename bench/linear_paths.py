"""Dense projections at decode batch sizes (a development probe, GPU): cuBLAS (F.linear) against the Triton
tensor-core projection of backends/fused/kernels/latent_moe.py (`linear`, weights on the MMA's M side), for every distinct
2-D bf16 weight shape of a preset's first layers. Each timing replays one CUDA graph of ROT calls on ROT
distinct copies of the weight (so the weight comes from HBM, not L2), median of do_bench; floor = weight
bytes / 4.57 TB/s. Tells where the fused executor's dense projections could take the Triton path.
Not yet run to completion on the H200 (its first version built the preset's weights on the host, which takes
minutes for k3-mini; it now reads the shapes from the parameter specs).

    python bench/linear_paths.py --preset k3-mini --batch 1,8,64 --out linear.json
"""

from __future__ import annotations

import argparse
import json

import torch

from megadecode.measure import HBM_READ_BPS, graph_replay_ms
from megadecode.backends.fused.kernels.latent_moe import linear
from megadecode.presets import preset_config
from megadecode.weights import param_specs

ROT = 8
CONFIGS = ({}, {"BLOCK_N": 32}, {"BLOCK_N": 16}, {"BLOCK_N": 128, "num_warps": 8}, {"BLOCK_K": 256, "num_stages": 4},
           {"BLOCK_N": 32, "BLOCK_K": 256, "num_stages": 4}, {"BLOCK_N": 16, "BLOCK_K": 256, "num_stages": 5})



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--out", default="linear.json")
    ap.add_argument("--extra", default="", help="more N x K shapes, e.g. 36864x7168,12384x7168 (concatenations)")
    ap.add_argument("--min-mb", type=float, default=0.0, help="leave out weights smaller than this")
    ap.add_argument("--x32", action="store_true", help="also time the Triton path on fp32 activations (hi + lo)")
    a = ap.parse_args()
    cfg = preset_config(a.preset)
    shapes = {}  # from the parameter specs: building a big preset's weights on the host takes minutes
    for name, s in param_specs(cfg).items():
        if len(s.shape) == 2 and s.quant is None and not s.fp32 and "embed" not in name and "lm_head" not in name:
            shapes.setdefault(tuple(s.shape), name)
    for e in filter(None, a.extra.split(",")):
        n, k = (int(v) for v in e.lower().split("x"))
        shapes.setdefault((n, k), f"extra {e}")
    shapes = {nk: n for nk, n in shapes.items() if nk[0] * nk[1] * 2 >= a.min_mb * 1e6}
    rows = []
    for (N, K), name in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
        floor = N * K * 2 / HBM_READ_BPS * 1e3
        for T in [int(b) for b in a.batch.split(",")]:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(T, N, device="cuda", dtype=torch.bfloat16) for _ in range(ROT)]
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            got = linear(x, ws[0], out_dtype=torch.bfloat16).float()
            err = float((got - ref).abs().max() / ref.abs().max())
            t_cublas = graph_replay_ms(lambda: [torch.mm(x, wi.t(), out=o) for wi, o in zip(ws, outs)], ROT)
            tried = {}
            for i, cfg_b in enumerate(CONFIGS):
                tried[i] = graph_replay_ms(lambda: [linear(x, wi, out=o, blocks=cfg_b) for wi, o in zip(ws, outs)],
                                           ROT)
            best = min(tried, key=tried.get)
            t_triton = tried[best]
            t_x32 = None
            if a.x32:
                x32 = x.float()
                t_x32 = graph_replay_ms(lambda: [linear(x32, wi, out=o, blocks=CONFIGS[best])
                                                 for wi, o in zip(ws, outs)], ROT)
            rows.append({"weight": name, "N": N, "K": K, "batch": T, "cublas_ms": t_cublas, "triton_ms": t_triton,
                         "triton_blocks": CONFIGS[best], "triton_all_ms": list(tried.values()), "floor_ms": floor,
                         "triton_x32_ms": t_x32, "err": err})
            print(f"{name[:44]:44s} {N:6d}x{K:<6d} b{T:<3d} cublas {t_cublas * 1e3:7.1f} us "
                  f"({floor / t_cublas:5.1%})  triton {t_triton * 1e3:7.1f} us ({floor / t_triton:5.1%})  "
                  f"err {err:.1e} {CONFIGS[best]}" + (f" x32 {t_x32 * 1e3:7.1f} us" if t_x32 else ""), flush=True)
        del ws
    json.dump({"gpu": torch.cuda.get_device_name(), "preset": a.preset, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
