"""The decode attention kernels (megadecode/backends/fused/kernels/mla.py: MLA over the latent cache; backends/fused/kernels/gqa.py: GQA over
the KV cache) under the Triton interpreter: against the reference attention (ragged positions, non-contiguous
slots, position 0), their harness variants, and the static sm_90 audits."""

from __future__ import annotations


import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    ON_GPU, DEVICE, import_interpreted, interpreter_env, static_audits,
    triton_gate,
)

ML = import_interpreted("megadecode.backends.fused.kernels.mla", "megadecode.validate.catalog")
GQ = import_interpreted("megadecode.backends.fused.kernels.gqa")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.step import Step  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402

TRITON_OK, needs_triton = triton_gate(ML.mla_split_kernel)



def _reference(q_lat, q_pe, cache, slots, positions, scale):
    out = []
    for n in range(q_lat.shape[0]):
        rows = cache[slots[n], : positions[n] + 1]  # [L, C + R]
        C = q_lat.shape[-1]
        s = (q_lat[n] @ rows[:, :C].T + q_pe[n] @ rows[:, C:].T) * scale  # [H, L]
        out.append(torch.softmax(s, -1) @ rows[:, :C])
    return torch.stack(out)


@needs_triton
@pytest.mark.parametrize("contiguous,splits", [(True, None), (False, None), (True, 1), (False, 3)])
def test_matches_reference_attention(contiguous, splits):
    g = torch.Generator().manual_seed(3)
    N, H, C, R, L = 4, 20, 48, 8, 70  # H not a multiple of BLOCK_H, C and R not powers of two
    q_lat, q_pe = torch.randn(N, H, C, generator=g), torch.randn(N, H, R, generator=g)
    cache = torch.randn(6, L, C + R, generator=g)
    positions = torch.tensor([0, 69, 33, 31])  # position 0: one row; 69: the whole cache; 31/33: tile edges
    slots = torch.arange(N) if contiguous else torch.tensor([5, 0, 2, 3])
    step = Step(tokens=torch.zeros(N, dtype=torch.long), positions=positions, slots=slots,
                logit_rows=torch.arange(N), kv_len=L, contiguous_slots=contiguous)
    args = [t.to(DEVICE) for t in (q_lat, q_pe, cache)]
    step = Step(tokens=step.tokens.to(DEVICE), positions=positions.to(DEVICE), slots=slots.to(DEVICE),
                logit_rows=step.logit_rows.to(DEVICE), kv_len=L, contiguous_slots=contiguous)
    got = ML.mla_decode_core(*args, step, 0.125, splits=splits)
    ref = _reference(*args, slots.to(DEVICE), positions.to(DEVICE), 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_rejects_bad_cache():
    step = Step(tokens=torch.zeros(1, dtype=torch.long), positions=torch.zeros(1, dtype=torch.long),
                slots=torch.zeros(1, dtype=torch.long), logit_rows=torch.zeros(1, dtype=torch.long), kv_len=1)
    with pytest.raises(ValueError, match="latent_cache must be"):
        ML.mla_decode_core(torch.randn(1, 2, 16), torch.randn(1, 2, 4), torch.randn(1, 4, 21), step, 1.0)


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-k3", "tiny-kimi-linear"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_variant_passes_check_op(preset, dtype):
    for batch in (1, 5):
        row = check_op(get("triton-mla-decode"), preset_config(preset), "attn_mla", dtype, batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
@pytest.mark.parametrize("contiguous,splits", [(True, None), (False, None), (True, 1), (False, 3), (True, 50)])
def test_gqa_matches_sdpa(contiguous, splits):
    """Split over the cache length: the default plan, one chunk, chunks past some sequences' positions (3 over
    70 positions with position 0 in the batch) and more chunks than tiles (clamped)."""
    g = torch.Generator().manual_seed(4)
    N, KH, G, d, L = 4, 2, 3, 24, 70  # G padded to 16, d not a power of two
    qg = torch.randn(N, KH, G, d, generator=g)
    kc, vc = torch.randn(6, L, KH, d, generator=g), torch.randn(6, L, KH, d, generator=g)
    positions = torch.tensor([0, 69, 33, 31])
    slots = torch.arange(N) if contiguous else torch.tensor([5, 0, 2, 3])
    step = Step(tokens=torch.zeros(N, dtype=torch.long).to(DEVICE), positions=positions.to(DEVICE),
                slots=slots.to(DEVICE), logit_rows=torch.arange(N).to(DEVICE), kv_len=L, contiguous_slots=contiguous)
    got = GQ.gqa_decode_core(qg.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), step, d ** -0.5, splits=splits)
    ref = []
    for n in range(N):
        k, v = kc[slots[n], : positions[n] + 1].transpose(0, 1), vc[slots[n], : positions[n] + 1].transpose(0, 1)
        ref.append(torch.softmax(qg[n] @ k.transpose(1, 2) * d ** -0.5, -1) @ v)  # [KH, G, d]
    torch.testing.assert_close(got.cpu(), torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_split_plan_covers_the_cache():
    from megadecode.backends.fused.kernels.splitk import split_plan

    for programs, kv_len, forced in [(4, 1025, None), (1, 1, None), (512, 4096, None), (4, 70, 3), (4, 70, 50)]:
        s, chunk = split_plan(programs, kv_len, 32, torch.device("cuda"), forced) if ON_GPU else \
            split_plan(programs, kv_len, 32, torch.device("cpu"), forced)
        assert chunk % 32 == 0 and s * chunk >= kv_len and (s - 1) * chunk < kv_len, (programs, kv_len, s, chunk)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gqa_decode_attention_matches_reference_op(dtype):
    """The whole op (norms, RoPE, cache write, split attention, o_proj) against reference gqa_attention,
    including the cache rows it writes."""
    from megadecode.reference.attention import gqa_attention
    from megadecode.reference.rope import rope_cos_sin
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-qwen3-moe")
    w = {k: v.to(DEVICE, dtype) for k, v in random_weights(cfg, "cpu", torch.float32, 0).items()}
    p = "model.layers.0.self_attn"
    g = torch.Generator().manual_seed(5)
    N, L = 3, 40
    x = torch.randn(N, cfg.hidden_size, generator=g).to(DEVICE, dtype)
    shape = (4, L, cfg.num_kv_heads, cfg.head_dim)
    kc, vc = (torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    positions, slots = torch.tensor([0, 39, 17], device=DEVICE), torch.tensor([3, 1, 0], device=DEVICE)
    step = Step(tokens=torch.zeros(N, dtype=torch.long, device=DEVICE), positions=positions, slots=slots,
                logit_rows=torch.arange(N, device=DEVICE), kv_len=L, contiguous_slots=False)
    kr, vr = kc.clone(), vc.clone()
    ref = gqa_attention(cfg, w, p, x, step, rope_cos_sin(cfg, positions, dtype), kr, vr)
    got = GQ.gqa_decode_attention(cfg, w, p, x, step, kc, vc, splits=2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc.float(), kr.float(), **tol)
    torch.testing.assert_close(vc, vr, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gqa_variant_passes_check_op(dtype):
    for batch in (1, 5):
        row = check_op(get("triton-gqa-decode"), preset_config("tiny-qwen3-moe"), "attn_gqa", dtype, batch,
                       seed=batch, device=DEVICE)
        assert row["status"] == "PASS", row


def test_static_audit_sm90():
    dtypes = [{"dtype": "bf16"}, {"dtype": "fp32"}]
    rows = static_audits(("megadecode.backends.fused.kernels.mla", dtypes), ("megadecode.backends.fused.kernels.gqa", dtypes))
    assert len(rows) == 10  # mla: split + merge; gqa: split + prologue + merge; per dtype

