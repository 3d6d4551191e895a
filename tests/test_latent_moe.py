"""Stable LatentMoE reference vs an independent einsum restatement (tiny dims, fp32), MXFP4 experts,
SiTU-GLU by hand, where the latent norm sits, and the selection-only bias."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megadecode.quant.mxfp4 import MXFP4Tensor
from megadecode.reference.activations import situ_glu
from megadecode.reference.latent_moe import LatentMoEParams, latent_experts, latent_moe_reference
from megadecode.reference.routing import route

P = LatentMoEParams(num_experts=16, top_k=4, hidden=64, latent=32, intermediate=16, shared_intermediate=32,
                    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6)


def make_weights(p: LatentMoEParams, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = p.weight_shapes()

    def rnd(name):
        shape = shapes[name]
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])

    w = {name: rnd(name) for name in shapes}
    w["router.bias"] = 0.1 * torch.randn(p.num_experts, generator=g)
    w["latent_norm.weight"] = 1 + 0.1 * torch.randn(p.latent, generator=g)
    w["experts.gate_up_proj"] *= 4  # reach the tanh soft caps a little
    return w


def restated(x, w, p, ids=None, rw=None, norm_per_expert=False):
    """The layer in einsums over (T, A); only `route` is shared with the code under test."""
    if ids is None:
        ids, rw = route(p, x, w["router.weight"], w["router.bias"])
    h = torch.einsum("td,rd->tr", x, w["latent_down.weight"])
    gu = torch.einsum("tafr,tr->taf", w["experts.gate_up_proj"][ids], h)  # [T, A, 2I]
    g, u = gu[..., :p.intermediate], gu[..., p.intermediate:]
    act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    y = torch.einsum("tari,tai->tar", w["experts.down_proj"][ids], act)  # [T, A, R]

    def norm(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + p.rms_norm_eps) * w["latent_norm.weight"]

    z = torch.einsum("ta,tar->tr", rw, norm(y) if norm_per_expert else y)
    if not norm_per_expert:
        z = norm(z)
    routed = torch.einsum("tr,dr->td", z, w["latent_up.weight"])
    sg = torch.einsum("td,sd->ts", x, w["shared_experts.gate_proj.weight"])
    su = torch.einsum("td,sd->ts", x, w["shared_experts.up_proj.weight"])
    shared = torch.einsum("ts,ds->td", sg * torch.sigmoid(sg) * su, w["shared_experts.down_proj.weight"])
    return routed + shared


def test_matches_einsum_restatement():
    w = make_weights(P)
    x = torch.randn(7, P.hidden, generator=torch.Generator().manual_seed(1))
    got = latent_moe_reference(x, w, P)
    torch.testing.assert_close(got, restated(x, w, P), rtol=1e-5, atol=1e-5)
    # routing: sigmoid on full-width x, groups, A picks per token, weights renormalised and scaled
    ids, rw = route(P, x, w["router.weight"], w["router.bias"])
    assert ids.shape == (7, P.top_k) and torch.allclose(rw.sum(-1), torch.full((7,), 2.5))


def test_no_groups_and_bf16_input():
    p = dataclasses.replace(P, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    w = make_weights(p, seed=3)
    x = torch.randn(5, p.hidden, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(latent_moe_reference(x, w, p), restated(x, w, p), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    got = latent_moe_reference(xb, w, p)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), restated(xb.float(), w, p), rtol=1e-2, atol=1e-2)


def test_mxfp4_experts_equal_dense_path_on_dequantized_weights():
    p = dataclasses.replace(P, intermediate=32)  # MXFP4 blocks of 32 along R and I
    w = make_weights(p, seed=5)
    q = dict(w)
    q["experts.gate_up_proj"] = MXFP4Tensor.quantize(w["experts.gate_up_proj"])
    q["experts.down_proj"] = MXFP4Tensor.quantize(w["experts.down_proj"])
    dq = dict(w)
    dq["experts.gate_up_proj"] = q["experts.gate_up_proj"].dequantize()
    dq["experts.down_proj"] = q["experts.down_proj"].dequantize()
    x = torch.randn(6, p.hidden, generator=torch.Generator().manual_seed(6))
    got = latent_moe_reference(x, q, p)
    assert torch.equal(got, latent_moe_reference(x, dq, p))
    torch.testing.assert_close(got, restated(x, dq, p), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, latent_moe_reference(x, w, p), atol=1e-4)  # quantization is not a no-op


def test_situ_glu_by_hand():
    def by_hand(g, u):
        return 4 * math.tanh(g / 4) * (1 / (1 + math.exp(-g))) * 25 * math.tanh(u / 25)

    pts = [(0.0, 3.0), (1.0, 1.0), (-2.0, 5.0), (8.0, -40.0), (30.0, 100.0)]
    got = situ_glu(torch.tensor([g for g, _ in pts], dtype=torch.float64),
                   torch.tensor([u for _, u in pts], dtype=torch.float64))
    assert got.tolist() == pytest.approx([by_hand(g, u) for g, u in pts], rel=1e-12)
    assert got[0].item() == 0.0
    assert got[1].item() == pytest.approx(4 * math.tanh(0.25) * 0.7310585786300049 * 25 * math.tanh(0.04))
    assert abs(got[4].item()) < 4 * 25  # both soft caps bound the product


def test_latent_norm_is_on_the_weighted_sum():
    w = make_weights(P, seed=7)
    x = torch.randn(5, P.hidden, generator=torch.Generator().manual_seed(8))
    got = latent_moe_reference(x, w, P)
    per_expert = restated(x, w, P, norm_per_expert=True)
    assert not torch.allclose(got, per_expert, atol=1e-3)
    # RMSNorm of the sum is blind to a common scale of the router weights; a per-expert norm is not
    p2 = dataclasses.replace(P, routed_scaling_factor=7.0)
    torch.testing.assert_close(latent_moe_reference(x, w, p2), got, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(restated(x, w, p2, norm_per_expert=True), per_expert, atol=1e-3)
    # a zero norm weight removes the whole routed path, leaving the shared experts
    w0 = dict(w, **{"latent_norm.weight": torch.zeros(P.latent)})
    shared_only = dict(w, **{"latent_up.weight": torch.zeros(P.hidden, P.latent)})
    torch.testing.assert_close(latent_moe_reference(x, w0, P), latent_moe_reference(x, shared_only, P))


def test_bias_selects_but_never_weights():
    p = dataclasses.replace(P, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    w = make_weights(p, seed=9)
    w["router.bias"] = torch.zeros(p.num_experts)
    w["router.bias"][[3, 11]] = 10.0  # forces experts 3 and 11 into every token's picks
    x = torch.randn(4, p.hidden, generator=torch.Generator().manual_seed(10))
    ids, rw = route(p, x, w["router.weight"], w["router.bias"])
    assert all({3, 11} <= set(row) for row in ids.tolist())
    s = torch.sigmoid(x @ w["router.weight"].T)
    expect = s.gather(1, ids) / s.gather(1, ids).sum(-1, keepdim=True)  # no bias in the weights
    torch.testing.assert_close(rw, expect)
    got = latent_moe_reference(x, w, p)
    torch.testing.assert_close(got, restated(x, w, p, ids=ids, rw=expect), rtol=1e-5, atol=1e-5)
    biased = (s + w["router.bias"]).gather(1, ids)
    biased = biased / biased.sum(-1, keepdim=True)
    assert not torch.allclose(got, restated(x, w, p, ids=ids, rw=biased), atol=1e-4)


def test_shapes_and_params_are_checked():
    w = make_weights(P)
    x = torch.randn(2, P.hidden)
    with pytest.raises(ValueError, match="latent_down.weight"):
        latent_moe_reference(x, dict(w, **{"latent_down.weight": torch.zeros(P.latent + 1, P.hidden)}), P)
    with pytest.raises(ValueError, match="missing 'router.bias'"):
        latent_moe_reference(x, {k: v for k, v in w.items() if k != "router.bias"}, P)
    with pytest.raises(ValueError, match="n_group"):
        dataclasses.replace(P, n_group=3)
    with pytest.raises(ValueError, match="sigmoid"):
        dataclasses.replace(P, score_func="softmax")


def test_k3_defaults():
    p = LatentMoEParams()
    s = p.weight_shapes()
    assert s["experts.gate_up_proj"] == (896, 6144, 3584) and s["experts.down_proj"] == (896, 3584, 3072)
    assert s["latent_down.weight"] == (3584, 7168) and s["shared_experts.down_proj.weight"] == (7168, 6144)
    assert (p.top_k, p.routed_scaling_factor) == (16, 1.0)


def test_experts_grouped_situ_matches_latent_experts():
    """The graph executor's grouped-GEMM expert path with act="situ" computes K3's SiTU-GLU experts."""
    from megadecode.reference.moe import experts_grouped

    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 32, generator=g) * 5
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(6)])
    w = torch.rand(6, 3, generator=g)
    gu, dn = torch.randn(7, 48, 32, generator=g) / 4, torch.randn(7, 32, 24, generator=g) / 4
    ref = latent_experts(x, ids, w, gu, dn, "situ")
    torch.testing.assert_close(experts_grouped(x, ids, w, gu, dn, "situ"), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(experts_grouped(x, ids, w, gu, dn, "silu"), ref, atol=1e-3)
    with pytest.raises(ValueError, match="act must be"):
        experts_grouped(x, ids, w, gu, dn, "gelu")
