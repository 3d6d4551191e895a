"""Time the Triton routed-expert paths against each other on the GPU (a development probe; the committed
figures come from `megadecode bench --preset k3-moe | qwen3-moe`): the small-batch FMA kernels
(backends/fused/kernels/fused_experts.py), the tensor-core kernels per pair (grouped=False) and grouped by expert
(grouped=True), over a few block configs, for the K3 (MXFP4 and bf16) and Qwen3-30B-A3B shapes.
Same method as bench_moe (rotating id sets in one CUDA graph, do_bench, floor = distinct experts' bytes).

    python bench/experts_paths.py --out paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from megadecode.measure import HBM_READ_BPS, SHAPES, expert_weights, graph_replay_ms
from megadecode.bench_moe import ROTATIONS, expert_inputs
from megadecode.backends.fused.kernels import fused_experts as fe
from megadecode.backends.fused.kernels import grouped_experts as ge

CONFIGS = [{"BLOCK_I": bi, "BLOCK_N": bn, "num_warps": nw, "num_stages": ns, "BLOCK_D": bd, "BLOCK_K": bd}
           for bi, bn in ((64, 64), (128, 128), (32, 32)) for nw in (4, 8) for ns in (3, 4) for bd in (64, 128)]


def time_path(fn, sets, outs):
    return graph_replay_ms(lambda: [fn(x, ids, w, o) for (x, ids, w), o in zip(sets, outs)], ROTATIONS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="paths.json")
    ap.add_argument("--budget", type=int, default=6, help="configs tried per (shape, path, batch)")
    ap.add_argument("--only", default=None, help="one case: k3-mxfp4, qwen3-bf16 or k3-bf16")
    args = ap.parse_args()
    rows = []
    cases = {"k3-mxfp4": ("k3", "mxfp4", (1, 8, 64, 256)), "qwen3-bf16": ("qwen3-30b-a3b", "bf16", (1, 8, 64)),
             "k3-bf16": ("k3", "bf16", (1, 8, 64))}
    for shape_name, wfmt, batches in ([cases[args.only]] if args.only else cases.values()):
        shape = SHAPES[shape_name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        gu, dn, eb = expert_weights(shape, wfmt, gen)
        act = shape["act"]
        for T in batches:
            sets = expert_inputs(shape, wfmt, T, gen)
            floor = statistics.mean(int(i.unique().numel()) for _, i, _ in sets) * eb / HBM_READ_BPS * 1e3
            ref = [fe.fused_experts(x, i, w, gu, dn, act=act) if T <= 16 else
                   ge.grouped_experts(x, i, w, gu, dn, act=act, grouped=True) for x, i, w in sets[:1]][0]
            paths = [("tc-grouped", lambda cfg: lambda x, i, w, o: ge.grouped_experts(
                x, i, w, gu, dn, act=act, out=o, blocks=cfg, grouped=True))]
            paths.append(("tc-pair", lambda cfg: lambda x, i, w, o: ge.grouped_experts(
                x, i, w, gu, dn, act=act, out=o, blocks=cfg, grouped=False)))
            if T <= 16:
                paths.append(("fma-fused", lambda cfg: lambda x, i, w, o: fe.fused_experts(
                    x, i, w, gu, dn, act=act, out=o, blocks=None)))
            for name, make in paths:
                best = None
                for cfg in (CONFIGS[: args.budget] if name != "fma-fused" else [None]):
                    outs = [torch.full_like(ref, float("nan")) for _ in sets]
                    try:
                        fn = make(cfg)
                        ms = time_path(fn, sets, outs)
                        x, i, w = sets[0]
                        o = torch.full_like(ref, float("nan"))
                        fn(x, i, w, o)
                        err = float((o.float() - ref.float()).abs().max() / ref.float().abs().max())
                    except Exception as ex:  # noqa: BLE001
                        rows.append({"shape": shape_name, "weights": wfmt, "batch": T, "path": name, "cfg": cfg,
                                     "error": f"{type(ex).__name__}: {str(ex)[:200]}"})
                        continue
                    r = {"shape": shape_name, "weights": wfmt, "batch": T, "path": name, "cfg": cfg, "ms": ms,
                         "floor_ms": floor, "mbu": floor / ms, "err_vs_first_path": err}
                    rows.append(r)
                    if best is None or ms < best["ms"]:
                        best = r
                if best:
                    print(f"{shape_name:<14} {wfmt:<6} T={T:<4} {name:<11} {best['ms']:.4f} ms  floor "
                          f"{best['floor_ms']:.4f}  MBU {best['mbu']:.1%}  err {best['err_vs_first_path']:.1e}  "
                          f"{best['cfg']}", flush=True)
        del gu, dn
        torch.cuda.empty_cache()
    errs = [r for r in rows if "error" in r]
    for r in errs[:3]:
        print("ERR", r)
    json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
