"""triton-kda-fused (megadecode/backends/fused/kernels/kda_fused.py) under the Triton interpreter: the harness's checks on the kimi
families (output, conv state and recurrent state against the reference, slots permuted and kept), the weight
packing the fused executor does for it (backends/fused/kernels/packed.py: values kept, views of one tensor, the caller's dict
too), a mutant the checks must catch, and the static sm_90 audit."""

from __future__ import annotations

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

KF = import_interpreted("megadecode.backends.fused.kernels.kda_fused", "megadecode.validate.catalog")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402

TRITON_OK, needs_triton = triton_gate(KF.kda_fused_kernel)


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_variant_passes_check_op(preset, dtype):
    for batch in (1, 5):
        row = check_op(get("triton-kda-fused"), preset_config(preset), "attn_kda", dtype, batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
def test_check_op_catches_a_wrong_delta_rule(monkeypatch):
    """The same variant with b_proj shifted by 0.05 (beta, the recurrence's update, off): the harness names the
    output and the state."""
    from megadecode.contract import Manifest, Variant

    base = get("triton-kda-fused")
    real = KF.kda_decode

    def off(cfg, w, prefix, x, step, conv_state, rec_state, out=None):
        b = w[f"{prefix}.b_proj.weight"]
        w = {**w, f"{prefix}.b_proj.weight": b + 0.05}  # sigmoid(b) moves: beta off
        return real(cfg, w, prefix, x, step, conv_state, rec_state, out)

    def run(op, inputs, weights, outputs, cfg, step, cache=None):
        off(cfg, weights, f"model.layers.{op.layer}.self_attn", inputs[op.inputs[0]], step, *cache,
            out=outputs[op.outputs[0]])

    m = base.manifest
    v = Variant(Manifest("t-kda-beta", "t", m.replaces, m.scope, uses_triton=True, kernels=m.kernels), run)
    row = check_op(v, preset_config("tiny-k3"), "attn_kda", "float32", 3, seed=1, device=DEVICE)
    assert row["status"] == "FAIL", row
    text = " ".join(row["failures"])
    assert "attn_out" in text and "cache[1]" in text, text


def test_pack_rows_keeps_values_and_makes_one_view():
    from megadecode.backends.fused.kernels import packed as KF  # plain torch: the fused executor's packing

    w = {n: torch.randn(r, 8) for n, r in zip("abc", (3, 5, 2))}
    caller = dict(w)
    before = {n: t.clone() for n, t in w.items()}
    assert not KF.adjacent([w["a"], w["b"], w["c"]])
    cat = KF.rows_view([w["a"], w["b"], w["c"]])  # not adjacent: a copy
    assert torch.equal(cat, torch.cat([before[n] for n in "abc"]))
    KF.pack_rows(w, ["a", "b", "c"], also=caller)
    assert all(torch.equal(w[n], before[n]) and caller[n] is w[n] for n in "abc")
    assert KF.adjacent([w["a"], w["b"], w["c"]])
    view = KF.rows_view([w["a"], w["b"], w["c"]])
    assert view.data_ptr() == w["a"].data_ptr() and view.shape == (10, 8)
    assert torch.equal(view, torch.cat([before[n] for n in "abc"]))
    assert not KF.adjacent([w["b"], w["a"]])  # order matters
    assert not KF.adjacent([w["a"], torch.randn(2, 4)])  # row lengths differ
    mixed = {"a": torch.randn(2, 8), "b": torch.randn(3, 8, dtype=torch.float64)}
    KF.pack_rows(mixed, ["a", "b"])  # dtypes differ: left as they are (a concatenation would promote them)
    assert mixed["b"].dtype == torch.float64 and not KF.adjacent([mixed["a"], mixed["b"]])


def test_decode_rejects_a_wrong_state():
    from megadecode.step import Step
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-k3")
    w = random_weights(cfg, "cpu", torch.float32, 0)
    H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel
    x = torch.randn(2, cfg.hidden_size)
    step = Step(tokens=torch.tensor([1, 2]), positions=torch.tensor([3, 3]), slots=torch.arange(2),
                logit_rows=torch.arange(2), kv_len=4, contiguous_slots=True)
    conv = torch.zeros(2, 3 * H * K, W - 1)
    with pytest.raises(ValueError, match="contiguous fp32 recurrent state"):
        KF.kda_decode(cfg, w, "model.layers.0.self_attn", x, step, conv, torch.zeros(2, H, K, K).half())


def test_static_audit_sm90():
    rows = static_audits(("megadecode.backends.fused.kernels.kda_fused", [{}]))
    assert len(rows) == 3  # the per-head kernel and both projections, coherent loads checked
