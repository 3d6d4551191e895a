"""A model of the decode step time of Kimi K3 against the number of GPUs (issue 17, item 5; docs/ep-model.md).

    python bench/ep_model.py                       # the tables of docs/ep-model.md
    python bench/ep_model.py --check EP.json --baseline ONE.json   # the model next to `megadecode bench` rows

Nothing here is measured: bytes come from the weight table (weights.weight_bytes) and the cache layout, expert
loads from uniform random routing (Monte Carlo), the HBM rate and the per-batch efficiency from our own H200
measurements (hardware.py, docs/results.md), and the communication from published figures (PUBLISHED, with sources).

step(G, B) = bytes on the busiest GPU / (HBM_READ_BPS x efficiency(B)) + MoE layers x combine(G, B)
             (+ 2 x layers x trunk all-reduce(T) for the tensor-parallel trunk)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from functools import lru_cache

import torch

from megadecode.cache import cache_bytes
from megadecode.config import config_from_hf
from megadecode.hardware import HBM_READ_BPS
from megadecode.presets import _K3, preset_config
from megadecode.weights import weight_bytes

H200_BYTES = 141e9  # NVIDIA H200 datasheet: 141 GB of HBM3e
HEADROOM = 10e9  # activations, graph pools, NCCL buffers: an allowance, not a measurement

# Published communication figures (not ours). Sources in docs/ep-model.md.
PUBLISHED = {
    # NCCL's own cost model (src/graph/tuning.cc, NVIDIA/nccl at 5067397c): ring, LL protocol
    "nccl_base_us": 6.6,  # base latency of a ring collective
    "nccl_nvlink_step_us": 0.6,  # per ring step over NVLink
    "nccl_net_step_us": 2.7,  # per ring step over the network (plus the fabric's own latency, not modelled)
    # ring all-reduce bus bandwidth of 8 x H100 SXM over NVLink 4, large messages (NVIDIA/nccl issue #1455)
    "nvlink_bus_bps": 365e9,
    # one 400 Gb/s NDR InfiniBand NIC per GPU (the HGX H100/H200 reference design)
    "ib_bps_per_gpu": 50e9,
}
GPUS_PER_NODE = 8

# Our H200 measurements (docs/results.md "Measured: Kimi K3 presets"): fused k3-mini MBU per batch, the efficiency a step of
# K3 layers reaches on one GPU today (533c9ba at batch 1 and 8, df9efe0 at 64)
MEASURED_MBU = {1: 0.447, 8: 0.309, 64: 0.249}


def k3(layers: int = 93):
    return config_from_hf({**_K3, "num_hidden_layers": layers})


@lru_cache(maxsize=None)
def busiest_rank_experts(batch: int, ranks: int, E: int = 896, A: int = 16, trials: int = 400) -> float:
    """E[max over ranks of the distinct experts a rank serves] for one layer, B tokens routed uniformly (A of E
    each, distinct per token), experts in contiguous blocks of E / ranks (seeded Monte Carlo)."""
    rng = random.Random(batch * 1000 + ranks)
    per = E // ranks
    total = 0
    for _ in range(trials):
        picked = set()
        for _ in range(batch):
            picked.update(rng.sample(range(E), A))
        load = [0] * ranks
        for e in picked:
            load[e // per] += 1
        total += max(load)
    return total / trials


def allgather_us(nbytes_per_rank: float, G: int) -> float:
    """One ring all-gather in NCCL's model: latency of G - 1 steps (network steps between nodes) + bytes / bw."""
    if G == 1:
        return 0.0
    P = PUBLISHED
    nodes = math.ceil(G / GPUS_PER_NODE)
    lat = P["nccl_base_us"] + (G - nodes) * P["nccl_nvlink_step_us"] + (nodes - 1) * P["nccl_net_step_us"]
    bw = P["nvlink_bus_bps"] if nodes == 1 else P["ib_bps_per_gpu"]
    return lat + (G - 1) * nbytes_per_rank / bw * 1e6


def allreduce_us(nbytes: float, G: int) -> float:
    """Ring all-reduce: 2 (G - 1) steps, 2 (G - 1) / G of the bytes per rank."""
    if G == 1:
        return 0.0
    P = PUBLISHED
    return P["nccl_base_us"] + 2 * (G - 1) * P["nccl_nvlink_step_us"] + 2 * (G - 1) / G * nbytes / P["nvlink_bus_bps"] * 1e6


def combine_us(G: int, B: int, width: int, mode: str) -> float:
    """One MoE layer's combine of fp32 partials [B, width] (parallel/combine.py)."""
    row = B * width * 4
    if mode == "all-gather":
        return allgather_us(row, G)
    block = math.ceil(B / G) * width * 4  # reduce-scatter (an all-to-all of row blocks), then an all-gather
    return 2 * allgather_us(block, G)


def step(cfg, G: int, B: int, context: int, tp: int = 1, mbu: dict | None = None) -> dict:
    """The busiest GPU's bytes and the modelled step of `cfg` on G GPUs (experts over G; the trunk replicated, or
    tensor-parallel over tp GPUs of a node), batch B at `context` tokens; `mbu`: the efficiency per batch
    (MEASURED_MBU by default)."""
    wb = weight_bytes(cfg, 2)
    moe = sum(cfg.moe_layers)
    experts = moe * busiest_rank_experts(B, G) * wb["expert"]
    cache = cache_bytes(cfg, B, context, torch.bfloat16)  # the KV / state the batch reads (all of it: attention is
    trunk = (wb["trunk"] + wb["lm_head"]) / tp            # replicated or tensor-parallel, never split by sequence)
    held = (wb["trunk"] + 2 * wb["lm_head"]) / tp + moe * cfg.num_experts / G * wb["expert"] + cache / tp
    nbytes = trunk + experts + cache / tp
    mbu = mbu or MEASURED_MBU
    eff = mbu[min(mbu, key=lambda b: abs(b - B))]
    hbm_ms = nbytes / (HBM_READ_BPS * eff) * 1e3
    width = cfg.latent_size or cfg.hidden_size
    comm = {m: moe * combine_us(G, B, width, m) / 1e3 for m in ("all-gather", "reduce-scatter")}
    mode = min(comm, key=comm.get)
    tp_ms = 2 * cfg.num_layers * allreduce_us(B * cfg.hidden_size * 2, tp) / 1e3
    ms = hbm_ms + comm[mode] + tp_ms
    return {"G": G, "B": B, "tp": tp, "held_GB": held / 1e9, "fits": held + HEADROOM <= H200_BYTES,
            "bytes_GB": nbytes / 1e9, "hbm_ms": hbm_ms, "comm_ms": comm[mode] + tp_ms, "mode": mode, "ms": ms,
            "comm_share": (comm[mode] + tp_ms) / ms, "tok_s": B / ms * 1e3}


def table(rows: list[dict]) -> str:
    out = ["| GPUs | trunk | batch | GB held / GPU | fits | GB read / GPU | HBM ms | comm ms (mode) | step ms | "
           "comm share | tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        trunk = "replicated" if r["tp"] == 1 else f"TP {r['tp']}"
        out.append(f"| {r['G']} | {trunk} | {r['B']} | {r['held_GB']:.0f} | {'yes' if r['fits'] else 'no'} | "
                   f"{r['bytes_GB']:.1f} | {r['hbm_ms']:.2f} | {r['comm_ms']:.2f} ({r['mode']}) | {r['ms']:.2f} | "
                   f"{r['comm_share']:.0%} | {r['tok_s']:.0f} |")
    return "\n".join(out)


def check(path: str, baseline: str | None) -> None:
    """The model beside each row of a `megadecode bench --ep N` result: the time the busiest GPU's bytes (the row's
    own count: bench's random weights route less evenly than uniform routing) take at the efficiency the same preset,
    executor and batch reached on one GPU (`baseline`, a one-GPU bench result; MEASURED_MBU without it), plus the
    modelled combines. Also the measured communication per MoE layer against the modelled one."""
    rows = json.loads(open(path).read())["rows"]
    one = {}
    if baseline:
        one = {(r["preset"], r["executor"], r["batch"]): r for r in json.loads(open(baseline).read())["rows"]
               if "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        cfg = preset_config(r["preset"])
        G, B, moe = r.get("ep", 1), r["batch"], sum(cfg.moe_layers)
        base = one.get((r["preset"], r["executor"], B))
        eff = base["mbu"] if base else MEASURED_MBU[min(MEASURED_MBU, key=lambda b: abs(b - B))]
        width = cfg.latent_size or cfg.hidden_size
        comm = {m: combine_us(G, B, width, m) for m in ("all-gather", "reduce-scatter")}
        layer_us = min(comm.values())
        model = r["bytes_per_step"] / (HBM_READ_BPS * eff) * 1e3 + moe * layer_us / 1e3
        measured_comm = r.get("comm_ms_per_layer")
        print(f"{r['preset']} {r['executor']} ep={G} batch={B}: measured {r['ms_per_step']:.2f} ms, model "
              f"{model:.2f} ms ({r['bytes_per_step'] / 1e9:.1f} GB on the busiest GPU at "
              f"{'its one-GPU' if base else 'the k3-mini'} MBU {eff:.1%}); combine per layer: measured "
              f"{'-' if measured_comm is None else f'{measured_comm * 1e3:.1f}'} us, model {layer_us:.1f} us"
              + ("" if base is None else f"; one GPU {base['ms_per_step']:.2f} ms"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", default=None, help="a bench/results JSON (megadecode bench --ep N) to compare with")
    ap.add_argument("--baseline", default=None, help="with --check: the one-GPU bench result of the same preset")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--efficiency", default=None,
                    help="a one-GPU bench result whose fused rows' MBU per batch replaces MEASURED_MBU")
    args = ap.parse_args()
    mbu = None
    if args.efficiency:
        mbu = {r["batch"]: r["mbu"] for r in json.loads(open(args.efficiency).read())["rows"]
               if r.get("executor") == "fused" and "error" not in r}
        if not mbu:
            raise SystemExit(f"{args.efficiency}: no fused rows")
        print(f"efficiency per batch from {args.efficiency}: " + ", ".join(f"{b}: {v:.3f}" for b, v in mbu.items()))
    if args.check:
        check(args.check, args.baseline)
        return 0
    full = k3()
    print("## Full Kimi K3 (93 layers), context", args.context)
    print(table([step(full, G, B, args.context, mbu=mbu) for G in (56, 64) for B in (1, 8, 64)]))
    print()
    print(table([step(full, G, B, args.context, tp=8, mbu=mbu) for G in (8, 16, 32, 64) for B in (1, 8, 64)]))
    print()
    print("## Predictions to check on the H200s (trunk replicated)")
    for p, gpus in (("k3-mini", (1, 2)), ("k3-ep", (2, 4)), ("k3-ep4", (4, 8)), ("k3-ep8", (8,))):
        print(f"### {p}")
        print(table([step(preset_config(p), G, B, args.context, mbu=mbu) for G in gpus for B in (1, 8, 64)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
