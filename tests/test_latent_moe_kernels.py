"""The Triton LatentMoE op (megadecode/backends/fused/kernels/latent_moe.py) under the Triton interpreter: the projection
kernel (with and without the fused RMSNorm), the registered variant in the harness on tiny-k3, and the static
sm_90 audit. Same interpreter arrangement as tests/test_fused_experts.py."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

LM = import_interpreted("megadecode.backends.fused.kernels.latent_moe", "megadecode.validate.catalog")
RT = import_interpreted("megadecode.backends.fused.kernels.router")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.norm import rms_norm  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402

TRITON_OK, needs_triton = triton_gate(LM.linear_kernel)



def _rel(got, ref):
    assert torch.isfinite(got).all()
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@needs_triton
@pytest.mark.parametrize("T", [1, 5, 19])
def test_linear_matches_f_linear(T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 96, generator=g).to(DEVICE)
    w = (torch.randn(40, 96, generator=g) / 10).to(DEVICE)
    assert _rel(LM.linear(x, w), F.linear(x, w)) < 1e-6
    # fp16 weights with fp32 activations: hi + lo split of the activations keeps ~22 bits
    assert _rel(LM.linear(x, w.half()), F.linear(x, w.half().float())) < 1e-5
    out16 = LM.linear(x.half(), w.half(), out_dtype=torch.float16)
    assert out16.dtype == torch.float16 and _rel(out16, F.linear(x.half().float(), w.half().float())) < 2e-3


@needs_triton
def test_linear_fused_rmsnorm_matches_norm_then_linear():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 80, generator=g) * 3).to(DEVICE)  # K = 80: a masked tail in the last chunk
    w = (torch.randn(50, 80, generator=g) / 9).to(DEVICE)  # N = 50: a masked tail in the last tile
    nw = (torch.rand(80, generator=g) + 0.5).to(DEVICE)
    ref = F.linear(rms_norm(x, nw, 1e-6), w)
    got = LM.linear(x, w, norm_weight=nw, eps=1e-6, blocks={"BLOCK_K": 32, "BLOCK_N": 16})
    assert _rel(got, ref) < 1e-6
    alone = LM.linear(x[3:4], w, norm_weight=nw, eps=1e-6, blocks={"BLOCK_K": 32, "BLOCK_N": 16})
    assert torch.equal(alone, got[3:4])  # each row's statistics are its own


def test_linear_rejects_bad_arguments():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="x \\[T, K\\] and w \\[N, K\\]"):
        LM.linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="unit stride"):
        LM.linear(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="norm_weight"):
        LM.linear(x, w, norm_weight=torch.ones(9))
    with pytest.raises(ValueError, match="float tensors"):
        LM.linear(x, w.to(torch.int8))


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch", [1, 5, 20])
def test_variant_passes_check_op_on_tiny_k3(dtype, batch):
    row = check_op(get("triton-latent-moe"), preset_config("tiny-k3"), "latent_moe", dtype, batch, seed=batch,
                   device=DEVICE)
    assert row["status"] == "PASS", row


@needs_triton
@pytest.mark.parametrize("dist", ["hot_expert", "exact_ties", "empty_experts"])
def test_variant_passes_routing_distributions(dist):
    row = check_op(get("triton-latent-moe"), preset_config("tiny-k3"), "latent_moe", "float32", 7, seed=3, dist=dist,
                   device=DEVICE)
    assert row["status"] == "PASS", row


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3"])
def test_router_split_matches_one_kernel(preset):
    """The router's default two-launch form (logits by `linear`, then selection) picks what the one-kernel
    form picks, with the same weights, and both match the reference route()."""
    from megadecode.reference.routing import route
    from megadecode.weights import random_weights

    cfg = preset_config(preset)
    w = random_weights(cfg, DEVICE, torch.float32, seed=4)
    layer = next(i for i, m in enumerate(cfg.moe_layers) if m)
    gate = w[f"model.layers.{layer}.mlp.gate.weight"]
    bias = w.get(f"model.layers.{layer}.mlp.gate.e_score_correction_bias") if cfg.score_func == "sigmoid" else None
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = []
    for split in (True, False):
        ids = torch.empty(9, cfg.top_k, dtype=torch.int64, device=DEVICE)
        wts = torch.empty(9, cfg.top_k, dtype=torch.float32, device=DEVICE)
        RT.route_triton(cfg, x, gate, bias, ids, wts, split=split)
        out.append((ids, wts))
    ref_ids, ref_w = route(cfg, x, gate, bias)
    for ids, wts in out:
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(wts, ref_w.float(), rtol=1e-5, atol=1e-6)


@needs_triton
def test_linear_partials_sum_to_the_projection():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 300, generator=g).to(DEVICE), torch.randn(24, 300, generator=g).to(DEVICE)
    parts = import_interpreted("megadecode.backends.fused.kernels.linear").linear_partials(x, w, 3)  # BLOCK_K 128: chunks of 128, 128, 44
    assert parts.shape == (3, 5, 24)
    torch.testing.assert_close(parts.sum(0), x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(parts[2], x[:, 256:] @ w[:, 256:].T, rtol=1e-5, atol=1e-4)


@needs_triton
def test_router_adds_k_chunks(monkeypatch):
    """With many SMs the logits come as several K chunks; the selection kernel adds them (a dropped chunk
    changes the route)."""
    from megadecode.backends.fused.kernels import splitk
    from megadecode.reference.routing import route

    monkeypatch.setattr(splitk, "num_sms", lambda device: 64)
    cfg = preset_config("tiny-qwen3-moe")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 300, generator=g).to(DEVICE)
    gate = torch.randn(cfg.num_experts, 300, generator=g).to(DEVICE)
    ids = torch.empty(6, cfg.top_k, dtype=torch.int64, device=DEVICE)
    wts = torch.empty(6, cfg.top_k, dtype=torch.float32, device=DEVICE)
    RT.route_triton(cfg, x, gate, None, ids, wts)
    ref_ids, ref_w = route(cfg, x, gate, None)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w.float(), rtol=1e-5, atol=1e-6)


def test_variant_scope():
    m = get("triton-latent-moe").manifest
    assert m.replaces == ("latent_moe",) and m.scope.families == ("kimi_k3",) and m.graph_capturable


def test_static_audit_sm90():
    rows = static_audits(("megadecode.backends.fused.kernels.linear", [{"dtype": "bf16", "norm": False},
                                                            {"dtype": "bf16", "norm": True},
                                                            {"dtype": "fp32", "norm": True}]))
    assert len(rows) == 3

