"""The KDA decode recurrence kernel (megadecode/backends/fused/kernels/kda.py) under the Triton interpreter: against the
reference delta_rule_step, on non-contiguous slots, its harness variant on the kimi families (output and
recurrent state compared), the fused executor using it end to end, and the static sm_90 audit."""

from __future__ import annotations


import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

KD = import_interpreted("megadecode.backends.fused.kernels.kda", "megadecode.validate.catalog")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.kda import decode_recurrence  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402

TRITON_OK, needs_triton = triton_gate(KD.kda_step_kernel)



def _inputs(B, H=3, K=16, V=16, slots=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, V, generator=g)
    gate = -torch.rand(B, H, K, generator=g)
    beta = torch.rand(B, H, generator=g)
    S = torch.randn(slots, H, K, V, generator=g) / 4
    return [t.to(DEVICE) for t in (q, k, v, gate, beta, S)]


@needs_triton
@pytest.mark.parametrize("rows", [slice(0, 4), [5, 0, 3, 1]])
def test_matches_reference_recurrence(rows):
    q, k, v, g, beta, S = _inputs(4)
    rows_t = rows if isinstance(rows, slice) else torch.tensor(rows, device=DEVICE)
    S_ref = S.clone()
    o_ref = decode_recurrence(q, k, v, g, beta, S_ref, rows_t)
    S_got = S.clone()
    o_got = KD.kda_decode_recurrence(q, k, v, g, beta, S_got, rows_t, block_v=8)  # two v-tiles per head
    torch.testing.assert_close(o_got, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_got, S_ref, rtol=1e-5, atol=1e-5)  # untouched slots included
    if not isinstance(rows, slice):
        assert torch.equal(S_got[[2, 4]], S[[2, 4]])  # slots not in the step keep their state bitwise


def test_rejects_bad_state():
    q, k, v, g, beta, S = _inputs(2)
    with pytest.raises(ValueError, match="rec_state must be contiguous fp32"):
        KD.kda_decode_recurrence(q, k, v, g, beta, S.half(), slice(0, 2))
    with pytest.raises(ValueError, match="rows must name 2 slots"):
        KD.kda_decode_recurrence(q, k, v, g, beta, S, torch.tensor([0, 1, 2], device=DEVICE))


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_variant_passes_check_op(preset, dtype):
    for batch in (1, 5):
        row = check_op(get("triton-kda-decode"), preset_config(preset), "attn_kda", dtype, batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
def test_fused_executor_runs_it_on_kimi_linear():
    from megadecode import Engine
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-kimi-linear")
    w = random_weights(cfg, DEVICE, torch.float32, seed=2)
    toks = {}
    for ex in ("torch", "fused"):
        e = Engine(cfg, w, executor=ex, max_batch=2, max_seq_len=24)
        out = [e.prefill([[1, 2, 3], [4]]).argmax(-1)]
        for _ in range(5):
            out.append(e.decode(out[-1]).argmax(-1))
        toks[ex] = (torch.stack(out, 1), e)
    assert torch.equal(toks["fused"][0], toks["torch"][0])
    assert toks["fused"][1].executor.chosen[("attn_kda", 2)] == "triton-kda-fused"  # preferred to triton-kda-decode


def test_static_audit_sm90():
    assert len(static_audits(("megadecode.backends.fused.kernels.kda", [{}]))) == 1  # passed, coherent loads checked



def test_fp32_cache_parts_follow_the_plan_op_kind():
    """The cache's fp32 parts are keyed by the plan's op kind, which the harness uses when it casts a case."""
    import torch

    from megadecode import plan as P
    from megadecode.cache import FP32_PARTS, part_dtype

    assert set(FP32_PARTS) <= {P.ATTN_KDA, P.ATTN_MLA, P.ATTN_GQA}
    assert part_dtype(P.ATTN_KDA, 1, torch.bfloat16) == torch.float32
    assert part_dtype(P.ATTN_KDA, 0, torch.bfloat16) == torch.bfloat16
