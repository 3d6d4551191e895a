"""The small-batch fused experts kernel (megadecode/backends/fused/kernels/fused_experts.py) under the Triton interpreter
(fp32, tiny dims), its registered variant in the harness, and the static sm_90 audit of both stages.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton).
"""

from __future__ import annotations


import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

FE = import_interpreted("megadecode.backends.fused.kernels.fused_experts", "megadecode.validate.catalog")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.quant.mxfp4 import MXFP4Tensor, dequantize_mxfp4  # noqa: E402
from megadecode.reference.latent_moe import latent_experts  # noqa: E402
from megadecode.reference.moe import experts_reference  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402

TRITON_OK, needs_triton = triton_gate(FE.experts_up_kernel)



def _problem(T, A=2, E=8, D=64, I=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]) if T else torch.zeros(0, A).long()
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


# ---- numerics ---------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("T", [1, 3, 16])
def test_silu_matches_experts_reference(T):
    x, ids, w, gu, dn = _problem(T, A=4, seed=T)
    _close(FE.fused_experts(x, ids, w, gu, dn), experts_reference(x, ids, w, gu, dn), 1e-5)


@needs_triton
def test_ragged_dims_and_small_blocks():
    """D, I not multiples of the blocks (masked tails), several reduction chunks, int32 ids."""
    x, ids, w, gu, dn = _problem(5, A=3, E=6, D=80, I=40, seed=7)
    blocks = {"BLOCK_I": 16, "BLOCK_D": 32, "BLOCK_N": 16, "BLOCK_K": 16}
    got = FE.fused_experts(x, ids.int(), w, gu, dn, blocks=blocks)
    _close(got, experts_reference(x, ids, w, gu, dn), 1e-5)


@needs_triton
@pytest.mark.parametrize("T", [1, 3, 16])
def test_situ_matches_latent_moe_restatement(T):
    x, ids, w, gu, dn = _problem(T, A=4, seed=10 + T)
    x = x * 6  # spread g and u over the soft caps' curved parts
    ref = latent_experts(x, ids, w, gu, dn, act="situ")
    _close(FE.fused_experts(x, ids, w, gu, dn, act="situ"), ref, 1e-5)


@needs_triton
@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_mxfp4_matches_dequantized_weights(T, act):
    x, ids, w, gu, dn = _problem(T, A=4, D=64, I=64, seed=20 + T)
    gq, dq = _mx(gu), _mx(dn)
    got = FE.fused_experts(x, ids, w, gq, dq, act=act)
    gf = dequantize_mxfp4(gq.packed, gq.scales)
    df = dequantize_mxfp4(dq.packed, dq.scales)
    _close(got, FE.fused_experts(x, ids, w, gf, df, act=act), 1e-5)  # same kernel, float weights
    _close(got, latent_experts(x, ids, w, gf, df, act=act), 1e-5)  # the reference on decoded weights
    if T == 1:  # (packed, scale) tuples are the same weights as MXFP4Tensor
        tup = FE.fused_experts(x, ids, w, (gq.packed, gq.scales), (dq.packed, dq.scales), act=act)
        assert torch.equal(tup, got)


@needs_triton
def test_mxfp4_decodes_every_code_and_scale_edge():
    """All 16 e2m1 codes (both nibbles) and e8m0 bytes 0 (2**-127), 1, 127, 140 decode exactly."""
    E, D, I = 2, 32, 32
    codes = torch.arange(D).remainder(16).repeat(E, 2 * I, 1)
    packed = (codes[..., 0::2] | (codes[..., 1::2].roll(1, -1) << 4)).to(torch.uint8)
    scales = torch.tensor([0, 1, 127, 140, 120, 130, 126, 128], dtype=torch.uint8).repeat(E, 8)[:, :2 * I, None]
    dp, ds = packed[:, :D, :I // 2].contiguous(), scales[:, :D].contiguous()
    gp, gs = packed.contiguous(), scales.contiguous()
    # A fixed input: with scales from 2**-127 to 2**13 in one row, some random inputs cancel badly enough
    # that fp32 summation order alone moves the result by 1e-4 relative (seen with an unseeded randn).
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(0))
    ids, w = torch.tensor([[1, 0]]), torch.tensor([[0.7, 0.3]])
    args = [t.to(DEVICE) for t in (x, ids, w, gp, gs, dp, ds)]
    got = FE.fused_experts(*args[:3], tuple(args[3:5]), tuple(args[5:7]))
    gu, dn = dequantize_mxfp4(args[3], args[4]), dequantize_mxfp4(args[5], args[6])
    ref = experts_reference(*args[:3], gu, dn)
    # This data's sums cancel almost exactly (terms ~1e4, results ~1e-4 from fp32 rounding alone), so the
    # error is measured against the size of the terms: the same computation on absolute values.
    terms = experts_reference(args[0].abs(), args[1], args[2], gu.abs(), dn.abs())
    err = (got.float() - ref.float()).abs().max().item()
    assert torch.isfinite(got).all() and err <= 1e-6 * terms.abs().max().item(), (err, terms.abs().max().item())


@needs_triton
def test_duplicate_experts_within_and_across_tokens():
    x, _, w, gu, dn = _problem(4, A=3, seed=3)
    ids = torch.tensor([[2, 2, 5], [2, 2, 2], [5, 2, 7], [7, 7, 2]], device=DEVICE)
    _close(FE.fused_experts(x, ids, w, gu, dn), experts_reference(x, ids, w, gu, dn), 1e-5)
    gq, dq = _mx(gu), _mx(dn)
    gf, df = gq.dequantize(), dq.dequantize()
    _close(FE.fused_experts(x, ids, w, gq, dq, act="situ"), latent_experts(x, ids, w, gf, df, act="situ"), 1e-5)


@needs_triton
def test_poisoned_output_and_scratch_fully_overwritten():
    x, ids, w, gu, dn = _problem(3, A=2, D=80, I=40, seed=5)
    out = torch.full_like(x, float("nan"))
    scratch = torch.full((6, 40), float("nan"), device=DEVICE)
    ret = FE.fused_experts(x, ids, w, gu, dn, out=out, scratch=scratch)
    assert ret is out and not out.isnan().any() and not scratch.isnan().any()
    _close(out, experts_reference(x, ids, w, gu, dn), 1e-5)
    again = FE.fused_experts(x, ids, w, gu, dn)
    assert torch.equal(again, out)  # deterministic


@needs_triton
def test_fp16_and_batch_invariance():
    x, ids, w, gu, dn = _problem(5, A=2, seed=9, dtype=torch.float16)
    got = FE.fused_experts(x, ids, w, gu, dn)
    assert got.dtype == torch.float16
    _close(got, experts_reference(x.float(), ids, w, gu.float(), dn.float()), 2e-3)
    for t in range(5):  # each row depends on its token only: bitwise equal alone and in the batch
        assert torch.equal(FE.fused_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn), got[t:t + 1])


# ---- launcher checks --------------------------------------------------------------------------------
def test_launcher_rejects_bad_arguments():
    x, ids, w, gu, dn = _problem(3, A=2, D=64, I=32)
    with pytest.raises(ValueError, match="grouped path"):
        big = _problem(17, A=2)
        FE.fused_experts(*big)
    with pytest.raises(ValueError, match="x must be a float"):
        FE.fused_experts(x.long(), ids, w, gu, dn)
    with pytest.raises(ValueError, match="ids must be"):
        FE.fused_experts(x, ids.float(), w, gu, dn)
    with pytest.raises(ValueError, match="weights must be"):
        FE.fused_experts(x, ids, w.half(), gu, dn)
    with pytest.raises(ValueError, match="unit stride"):
        FE.fused_experts(x.t().contiguous().t(), ids, w, gu, dn)
    with pytest.raises(ValueError, match="ids must be"):
        FE.fused_experts(x, ids.t().contiguous().t(), w, gu, dn)
    with pytest.raises(ValueError, match="gate_up: expected"):
        FE.fused_experts(x, ids, w, gu.transpose(1, 2).contiguous().transpose(1, 2), dn)
    with pytest.raises(ValueError, match="must share a dtype"):
        FE.fused_experts(x, ids, w, gu, dn.half())
    with pytest.raises(ValueError, match="must be \\[E, 2I"):
        FE.fused_experts(x, ids, w, gu, dn[:, :, :16])
    with pytest.raises(ValueError, match="act must be"):
        FE.fused_experts(x, ids, w, gu, dn, act="gelu")
    with pytest.raises(ValueError, match="exceeds E"):
        FE.fused_experts(x, torch.zeros(3, 9, dtype=torch.long), torch.ones(3, 9), gu, dn)
    with pytest.raises(ValueError, match="both be float or both be MXFP4"):
        FE.fused_experts(x, ids, w, _mx(gu), dn)
    with pytest.raises(ValueError, match="out must be"):
        FE.fused_experts(x, ids, w, gu, dn, out=torch.empty(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="ids out of range"):
        FE.fused_experts(x, torch.tensor([[0, 8], [1, 2], [3, 4]]), w, gu, dn, check_ids=True)
    # MXFP4 with D not a multiple of 32: packed [E, 2I, 24/2] has K=24, which MXFP4Tensor itself refuses,
    # and a hand-built pair with consistent shapes is refused by the launcher
    x48 = torch.randn(1, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        FE.fused_experts(x48, ids[:1], w[:1], (torch.zeros(8, 64, 24, dtype=torch.uint8),
                                               torch.zeros(8, 64, 1, dtype=torch.uint8)),
                         (torch.zeros(8, 48, 16, dtype=torch.uint8), torch.zeros(8, 48, 1, dtype=torch.uint8)))


# ---- the registered variant in the harness ------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_variant_passes_check_op(preset, batch):
    v = get("triton-fused-experts")
    row = check_op(v, preset_config(preset), "experts", "float32", batch, seed=batch, device=DEVICE)
    assert row["status"] == "PASS", row


def test_variant_scope():
    v = get("triton-fused-experts")
    m = v.manifest
    assert m.replaces == ("experts",) and m.uses_triton and m.graph_capturable
    assert m.scope.batch == (1, 16) and m.scope.arch == "sm_90"
    assert "batch 17" in v.supports(preset_config("tiny-qwen3-moe"), torch.float32, 17, "cpu")


# ---- static audit at sm_90 (compiled, not interpreted) ------------------------------------------------
def test_static_audit_sm90_both_stages():
    rows = static_audits(("megadecode.backends.fused.kernels.fused_experts", [
        {"dtype": "bf16", "mxfp4": False, "act": "silu"}, {"dtype": "bf16", "mxfp4": True, "act": "situ"},
        {"dtype": "fp16", "mxfp4": True, "act": "silu"}]))
    assert {r[0] for r in rows} == {"experts_up_kernel", "experts_down_kernel"} and len(rows) == 6

