"""The grouped routed-experts kernels (megadecode/backends/fused/kernels/grouped_experts.py) under the Triton interpreter
(fp32, tiny dims), the batch dispatch of routed_experts, the registered variant, and the static sm_90 audit.
Same interpreter arrangement as tests/test_fused_experts.py."""

from __future__ import annotations


import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

GE = import_interpreted("megadecode.backends.fused.kernels.grouped_experts", "megadecode.validate.catalog")
FE = GE.fe

from megadecode.presets import preset_config  # noqa: E402
from megadecode.quant.mxfp4 import MXFP4Tensor  # noqa: E402
from megadecode.reference.latent_moe import latent_experts  # noqa: E402
from megadecode.reference.moe import experts_reference  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402

TRITON_OK, needs_triton = triton_gate(GE.grouped_up_kernel)
SMALL = {"BLOCK_M": 16, "BLOCK_I": 16, "BLOCK_D": 32, "BLOCK_N": 16, "BLOCK_K": 32}



def _problem(T, A=3, E=8, D=64, I=32, seed=0, dtype=torch.float32, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    w = torch.rand(T, A, generator=g) + 0.1
    gu = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
    return [t.to(DEVICE) for t in (x, ids, w, gu, dn)]


def _close(got, ref, tol):
    got, ref = got.float(), ref.float()
    err = (got - ref).abs().max().item()
    assert torch.isfinite(got).all() and err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


def _mx(w):
    q = MXFP4Tensor.quantize(w.cpu())
    return MXFP4Tensor(q.packed.to(DEVICE), q.scales.to(DEVICE))


def test_group_pairs_sorts_by_expert_stably():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3]])
    order, offs = GE.group_pairs(ids, 5)
    assert order.dtype == offs.dtype == torch.int32
    assert order.tolist() == [3, 1, 2, 0, 4, 5] and offs.tolist() == [0, 1, 3, 3, 6, 6]


@needs_triton
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("T", [1, 5, 24])
def test_silu_matches_experts_reference(T, grouped):
    x, ids, w, gu, dn = _problem(T, seed=T)
    got = GE.grouped_experts(x, ids, w, gu, dn, blocks=SMALL, grouped=grouped)
    _close(got, experts_reference(x, ids, w, gu, dn), 1e-5)


@needs_triton
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_mxfp4_matches_reference_on_decoded_weights(act, grouped):
    """fp32 activations (split into fp16 hi + lo for the MMAs) against the reference on decoded weights."""
    x, ids, w, gu, dn = _problem(20, A=4, D=64, I=64, seed=3)
    x = x * 4
    gq, dq = _mx(gu), _mx(dn)
    ref = latent_experts(x, ids, w, gq.dequantize(), dq.dequantize(), act=act)
    _close(GE.grouped_experts(x, ids, w, gq, dq, act=act, grouped=grouped), ref, 1e-5)
    _close(GE.grouped_experts(x, ids, w, gq, dq, act=act, blocks={**SMALL, "BLOCK_M": 32}, grouped=grouped), ref, 1e-5)


@needs_triton
def test_hot_expert_and_empty_experts():
    """Every token on expert 2 (more pairs than BLOCK_M = 16: the chunk loop runs twice), expert 7 never
    picked, ragged D and I (masked tails), int32 ids."""
    T, A = 20, 2
    ids = torch.stack([torch.tensor([2, i % 6]) if i % 6 != 2 else torch.tensor([2, 5]) for i in range(T)])
    x, ids, w, gu, dn = _problem(T, A=A, D=80, I=40, seed=5, ids=ids)
    ref = experts_reference(x, ids, w, gu, dn)
    _close(GE.grouped_experts(x, ids.int(), w, gu, dn, blocks=SMALL), ref, 1e-5)
    same = torch.full((T, 1), 4, device=DEVICE)
    _close(GE.grouped_experts(x, same, w[:, :1].contiguous(), gu, dn, blocks=SMALL),
           experts_reference(x, same, w[:, :1], gu, dn), 1e-5)


@needs_triton
def test_poisoned_output_fully_written_deterministic_and_batch_invariant():
    x, ids, w, gu, dn = _problem(18, seed=8)
    out = torch.full_like(x, float("nan"))
    ret = GE.grouped_experts(x, ids, w, gu, dn, out=out, blocks=SMALL)
    assert ret is out and not out.isnan().any()
    assert torch.equal(GE.grouped_experts(x, ids, w, gu, dn, blocks=SMALL), out)
    for t in (0, 17):  # a row alone equals the row in the batch
        alone = GE.grouped_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn, blocks=SMALL)
        assert torch.equal(alone, out[t:t + 1])


@needs_triton
def test_fp16_activations():
    x, ids, w, gu, dn = _problem(17, seed=9, dtype=torch.float16)
    got = GE.grouped_experts(x, ids, w, gu, dn)
    assert got.dtype == torch.float16
    _close(got, experts_reference(x.float(), ids, w, gu.float(), dn.float()), 2e-3)


@needs_triton
def test_routed_experts_picks_the_path_by_weights_and_batch(monkeypatch):
    """Float weights: the tensor-core kernels at every batch. MXFP4 above 16 tokens: the tensor-core kernels. MXFP4
    at <= 16 tokens: the tensor-core kernels on the GPU when every scale byte allows the fast decode (fast_scales),
    else (scales out of that range, or the CPU) the FMA kernels. (The test used to expect the FMA kernels on the GPU
    too: the H200 took the tensor-core path, as routed_experts says it must, since the random weights' scale bytes
    all lie in FAST_SCALES.)"""
    calls = []
    for mod, name in ((FE, "fused_experts"), (GE, "grouped_experts")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    on_gpu = DEVICE == "cuda"
    expected = []
    for T in (16, 17):
        x, ids, w, gu, dn = _problem(T, seed=T)
        _close(GE.routed_experts(x, ids, w, gu, dn), experts_reference(x, ids, w, gu, dn), 1e-5)
        expected.append("grouped_experts")
        for scale in (1.0, 2.0 ** 8):  # 2**8: the down weights' scale bytes above FAST_SCALES' range
            gq, dq = _mx(gu), _mx(dn * scale)
            fast = bool(GE.fast_scales(gq.scales, dq.scales))
            assert fast == (scale == 1.0)
            ref = latent_experts(x, ids, w, gq.dequantize(), dq.dequantize(), act="silu")
            _close(GE.routed_experts(x, ids, w, gq, dq), ref, 1e-5)
            expected.append("grouped_experts" if T > 16 or (on_gpu and fast) else "fused_experts")
    assert calls == expected


def test_launcher_rejects_bad_arguments():
    x, ids, w, gu, dn = _problem(3)
    with pytest.raises(ValueError, match="ids must be"):
        GE.grouped_experts(x, ids.float(), w, gu, dn)
    with pytest.raises(ValueError, match="must be \\[E, 2I"):
        GE.grouped_experts(x, ids, w, gu, dn[:, :, :16])
    with pytest.raises(ValueError, match="both be float or both be MXFP4"):
        GE.grouped_experts(x, ids, w, _mx(gu), dn)
    with pytest.raises(ValueError, match="ids out of range"):
        GE.grouped_experts(x, torch.tensor([[0, 8, 1], [1, 2, 3], [3, 4, 5]]), w, gu, dn, check_ids=True)
    with pytest.raises(ValueError, match=f"batch <= {GE.MAX_BATCH}"):
        GE.grouped_experts(*_problem(GE.MAX_BATCH + 1, A=1, E=2, D=32, I=32))


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("batch", [1, 20])
def test_variant_passes_check_op(preset, batch):
    row = check_op(get("triton-grouped-experts"), preset_config(preset), "experts", "float32", batch, seed=batch,
                   device=DEVICE)
    assert row["status"] == "PASS", row


def test_static_audit_sm90_all_kernels():
    rows = static_audits(("megadecode.backends.fused.kernels.grouped_experts", [
        {"dtype": "bf16", "mxfp4": False, "act": "silu"}, {"dtype": "fp32", "mxfp4": True, "act": "situ"},
        {"dtype": "fp32", "mxfp4": True, "act": "situ", "grouped": False},
        {"dtype": "fp32", "mxfp4": True, "act": "situ", "fast": True}]))
    assert {r[0] for r in rows} == {"grouped_up_kernel", "grouped_down_kernel", "combine_kernel",
                                    "mx_prep_kernel"} and len(rows) == 15  # 3 kernels, + the prep for MXFP4



def test_fast_scales_checks_the_range_once_per_tensor():
    lo, hi = GE.FAST_SCALES
    ok = torch.tensor([lo, hi, 120], dtype=torch.uint8)
    bad = torch.tensor([lo - 1, 120], dtype=torch.uint8)
    assert GE.fast_scales(ok) and not GE.fast_scales(ok, bad) and not GE.fast_scales(torch.tensor([hi + 1]))
    assert GE._SCALES_CHECKED[id(ok)][1] is True


@needs_triton
@pytest.mark.parametrize("grouped", [True, False])
def test_fast_mxfp4_path_matches_reference_and_exact_path(grouped):
    """Scales in FAST_SCALES take the fast decode (inline PTX on the GPU, the same arithmetic in plain Triton
    under the interpreter) with fp16 activation planes; it must match the reference on decoded weights, also
    for activations far outside fp16's range (the launcher scales them by a power of two on the device).
    A scale byte out of range sends the call to the exact per-block path, which must agree too. Per pair, 6 tokens
    (24 pairs, each its own programs: 20 tokens took 190 s of the CPU suite under the interpreter); grouped, 20."""
    x, ids, w, gu, dn = _problem(20 if grouped else 6, A=4, D=256, I=128, seed=12)
    gq, dq = _mx(gu), _mx(dn)
    assert GE.fast_scales(gq.scales, dq.scales)
    x = x / 8
    ref = latent_experts(x, ids, w, gq.dequantize(), dq.dequantize(), act="situ")
    _close(GE.grouped_experts(x, ids, w, gq, dq, act="situ", grouped=grouped), ref, 1e-5)
    # one activation column far past fp16's 65504, its gate/up weights zero: without the launcher's
    # power-of-two scaling the fp16 plane would hold inf and inf * 0 = NaN would reach the output
    big = x.clone()
    big[:, 5] = 2e5
    packed = gq.packed.clone()
    packed[:, :, 2] &= 0x0F  # column 5 = the high nibble of byte 2: code 0
    g0 = MXFP4Tensor(packed, gq.scales)
    ref = latent_experts(big, ids, w, g0.dequantize(), dq.dequantize(), act="situ")
    _close(GE.grouped_experts(big, ids, w, g0, dq, act="situ", grouped=grouped), ref, 1e-5)
    s_exact = gq.scales.clone()
    s_exact.view(-1)[-1] = GE.FAST_SCALES[1] + 1
    g_exact = MXFP4Tensor(gq.packed, s_exact)
    assert not GE.fast_scales(s_exact, dq.scales)
    ref = latent_experts(x, ids, w, g_exact.dequantize(), dq.dequantize(), act="situ")
    _close(GE.grouped_experts(x, ids, w, g_exact, dq, act="situ", grouped=grouped), ref, 1e-5)
    g0_exact = MXFP4Tensor(packed, s_exact)  # the exact path scales x into fp16's range as well
    ref = latent_experts(big, ids, w, g0_exact.dequantize(), dq.dequantize(), act="situ")
    _close(GE.grouped_experts(big, ids, w, g0_exact, dq, act="situ", grouped=grouped), ref, 1e-5)


@needs_triton
@pytest.mark.parametrize("fast", [True, False])
def test_mxfp4_tokens_scaled_alone(fast):
    """mx_prep_kernel scales each token by its own power of two: a token's result is bit-identical alone and
    next to a token 1e6 times larger (with one scale for the batch, the small token's fp16 lo parts would go
    subnormal and lose bits). fast=False: a scale byte out of FAST_SCALES sends the call to the exact path."""
    x, ids, w, gu, dn = _problem(5, A=2, D=128, I=64, seed=13)
    gq, dq = _mx(gu), _mx(dn)
    if not fast:
        s = gq.scales.clone()
        s.view(-1)[-1] = GE.FAST_SCALES[1] + 1
        gq = MXFP4Tensor(gq.packed, s)
    assert GE.fast_scales(gq.scales, dq.scales) == fast
    x[0] *= 0.1  # (much smaller tokens make h small, where its fp16 parts lose relative precision)
    x[3] *= 1e6
    batch = GE.grouped_experts(x, ids, w, gq, dq, act="situ", grouped=False)
    for t in (0, 1, 3):
        alone = GE.grouped_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gq, dq, act="situ", grouped=False)
        assert torch.equal(alone, batch[t:t + 1]), t
    ref = latent_experts(x, ids, w, gq.dequantize(), dq.dequantize(), act="situ")
    for t in range(5):
        _close(batch[t:t + 1], ref[t:t + 1], 1e-5)


@needs_triton
def test_mxfp4_nan_token_stays_in_its_row():
    """A NaN (or inf) activation reaches that token's output (never a finite answer) and leaves the other
    tokens' results unchanged; an all-zero token gives zeros."""
    x, ids, w, gu, dn = _problem(4, A=2, D=128, I=64, seed=14)
    gq, dq = _mx(gu), _mx(dn)
    clean = GE.grouped_experts(x, ids, w, gq, dq, act="situ", grouped=False)
    bad = x.clone()
    bad[1, 7] = float("nan")
    bad[2, 3] = float("inf")
    bad[3] = 0.0
    got = GE.grouped_experts(bad, ids, w, gq, dq, act="situ", grouped=False)
    assert got[1].isnan().any() and not got[2].isfinite().all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[3], torch.zeros_like(got[3]))
