"""lm_head + next-token selection at decode batch sizes (a development probe, GPU): the graph executor's way
(cuBLAS F.linear, .float(), then sampling.sample's torch ops) against backends/fused/kernels/lm_head.py's lm_head_sample (two
launches), both captured in a CUDA graph and timed by do_bench (median). Floor = the lm_head weight's bytes /
4.57 TB/s. Shapes: Qwen3-30B-A3B (151936 x 2048) and K3 (163840 x 7168), bf16.

    python bench/lm_head_paths.py --out lm_head.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from megadecode.measure import HBM_READ_BPS, graph_replay_ms
from megadecode.backends.fused.kernels.lm_head import lm_head_sample
from megadecode.sampling import SamplingParams, sample

SHAPES = {"qwen3-30b-a3b": (151936, 2048), "k3": (163840, 7168)}



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--out", default="lm_head.json")
    a = ap.parse_args()
    rows = []
    for name, (V, D) in SHAPES.items():
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
        floor = V * D * 2 / HBM_READ_BPS * 1e3
        for T in [int(b) for b in a.batch.split(",")]:
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.8)):
                seed = torch.zeros(1, dtype=torch.int64, device="cuda")
                ref = graph_replay_ms(lambda: sample(F.linear(x, w).float(), params))
                mine = graph_replay_ms(lambda: lm_head_sample(x, w, params, seed=seed))
                agree = None
                if params.greedy:
                    agree = bool(torch.equal(lm_head_sample(x, w, params)[0], F.linear(x, w).float().argmax(-1)))
                mode = "greedy" if params.greedy else "temperature"
                rows.append({"shape": name, "V": V, "D": D, "batch": T, "mode": mode, "torch_ms": ref,
                             "triton_ms": mine, "floor_ms": floor, "greedy_tokens_agree": agree})
                print(f"{name:14s} b{T:<3d} {mode:11s} cuBLAS+sample {ref * 1e3:8.1f} us ({floor / ref:5.1%})  "
                      f"lm_head_sample {mine * 1e3:8.1f} us ({floor / mine:5.1%})  agree {agree}", flush=True)
        del w
    json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
