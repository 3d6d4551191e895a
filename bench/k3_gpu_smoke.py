"""First GPU look at K3 pieces (H200): tiny-k3 `graph` (fused MXFP4 experts, captured) vs `torch`, in fp32
and bf16; then `fused_experts` at true K3 expert dims (R 3584, I 3072, SiTU, MXFP4, 16 of E=64 experts
per token) against `latent_experts` and timed with do_bench (median), floor = distinct experts' packed
bytes / 4.57 TB/s. Writes $OUT/k3_gpu_smoke.json when OUT is set.
    python bench/k3_gpu_smoke.py
"""

from __future__ import annotations

import json
import os

import torch

from megadecode import Engine, SamplingParams
from megadecode.presets import preset_config
from megadecode.weights import random_weights


def engines_agree(dtype) -> dict:
    cfg = preset_config("tiny-k3")
    w = random_weights(cfg, "cuda", dtype, seed=1)
    prompts = [[256, 72, 101, 108], [256, 7], [256, 1, 2, 3, 4, 5]]
    ref = Engine(cfg, w, executor="torch", max_batch=4, max_seq_len=64)
    fast = Engine(cfg, w, executor="graph", max_batch=4, max_seq_len=64)
    la, lb = ref.prefill(prompts), fast.prefill(prompts)
    tok, worst = la.argmax(-1), 0.0
    for _ in range(8):
        a, b = ref.decode(tok), fast.decode(tok)
        worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
        tok = a.argmax(-1)
    ga = ref.generate(prompts, 12, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    gb = fast.generate(prompts, 12, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    return {"dtype": str(dtype), "max_rel_logit_err": worst, "greedy_equal": ga == gb,
            "graphs_captured": len(fast.executor._graphs)}


def fused_at_k3_dims(batch: int) -> dict:
    from triton.testing import do_bench

    from megadecode.kernels.fused_experts import fused_experts
    from megadecode.quant.mxfp4 import MXFP4Tensor
    from megadecode.reference.latent_moe import latent_experts

    E, A, R, I = 64, 16, 3584, 3072
    g = torch.Generator(device="cuda").manual_seed(0)
    gu = MXFP4Tensor(torch.randint(0, 256, (E, 2 * I, R // 2), device="cuda", dtype=torch.uint8, generator=g),
                     torch.randint(118, 124, (E, 2 * I, R // 32), device="cuda", dtype=torch.uint8, generator=g))
    dn = MXFP4Tensor(torch.randint(0, 256, (E, R, I // 2), device="cuda", dtype=torch.uint8, generator=g),
                     torch.randint(118, 124, (E, R, I // 32), device="cuda", dtype=torch.uint8, generator=g))
    x = torch.randn(batch, R, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:A] for _ in range(batch)])
    w = torch.rand(batch, A, device="cuda", generator=g)
    got = fused_experts(x, ids, w, gu, dn, act="situ")
    ref = latent_experts(x.float(), ids, w, gu, dn, "situ")
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    ms = do_bench(lambda: fused_experts(x, ids, w, gu, dn, act="situ"))
    distinct = int(torch.unique(ids).numel())
    floor_ms = distinct * gu.nbytes / E * 1e3 / 4.57e12 + distinct * dn.nbytes / E * 1e3 / 4.57e12
    return {"batch": batch, "experts": E, "active": A, "distinct": distinct, "rel_err_vs_reference": err,
            "ms": ms, "floor_ms": floor_ms, "mbu": floor_ms / ms}


def main() -> None:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["tiny_k3_graph_vs_torch"] = [engines_agree(torch.float32), engines_agree(torch.bfloat16)]
    print(json.dumps(out["tiny_k3_graph_vs_torch"], indent=1), flush=True)
    out["fused_experts_k3_dims_mxfp4"] = [fused_at_k3_dims(b) for b in (1, 8)]
    print(json.dumps(out["fused_experts_k3_dims_mxfp4"], indent=1), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "k3_gpu_smoke.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
