"""triton-mlp (megadecode/backends/fused/kernels/mlp.py) under the Triton interpreter: the harness's checks on every family with
an MLP op (dense layers, shared experts), at batches on both sides of packed.project's switch to cuBLAS, a
rounding mutant the checks must catch, and the static sm_90 audit."""

from __future__ import annotations

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

MK = import_interpreted("megadecode.backends.fused.kernels.mlp", "megadecode.validate.catalog")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402

TRITON_OK, needs_triton = triton_gate(MK.swiglu_kernel)


@needs_triton
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-kimi-linear", "tiny-k3"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_variant_passes_check_op(preset, dtype):
    for batch in (1, 5, 17):  # 17: cuBLAS projections (packed.LINEAR_MAX_TOKENS = 16)
        row = check_op(get("triton-mlp"), preset_config(preset), "mlp", dtype, batch, seed=batch, device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
def test_check_op_catches_a_missing_rounding():
    """The SiLU product 1% off (and without the reference's rounding of silu(g) to fp16 first): caught."""
    from megadecode.contract import Manifest, Variant

    def run(op, inputs, weights, outputs, cfg, step, cache=None):
        gate, up, down = (weights[n] for n in op.weights)
        x = inputs[op.inputs[0]]
        g, u = torch.nn.functional.linear(x, gate).float(), torch.nn.functional.linear(x, up).float()
        h = (torch.nn.functional.silu(g) * u * 1.01).to(x.dtype)
        outputs[op.outputs[0]].copy_(torch.nn.functional.linear(h, down))

    m = get("triton-mlp").manifest
    v = Variant(Manifest("t-mlp-off", "t", m.replaces, m.scope, uses_triton=True, kernels=m.kernels), run)
    row = check_op(v, preset_config("tiny-k3"), "mlp", "float16", 5, seed=1, device=DEVICE)
    assert row["status"] == "FAIL", row


def test_rejects_mismatched_weights():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="gate, up"):
        MK.swiglu_mlp_fused(x, torch.zeros(4, 8), torch.zeros(5, 8), torch.zeros(8, 4))


def test_static_audit_sm90():
    assert len(static_audits(("megadecode.backends.fused.kernels.mlp", [{}]))) == 3


def test_tuned_blocks_give_way_to_the_defaults_where_they_would_not_fit_shared_memory():
    """packed.fit_blocks: the blocks tuned on bf16 weights (the MLP's down projection, KDA's o_proj, the LatentMoE
    projections) asked the H200 for 240 KB of shared memory with fp32 weights and failed to launch (4228b59)."""
    from megadecode.backends.fused.kernels.cute_experts import LATENT_BLOCKS
    from megadecode.backends.fused.kernels.packed import SMEM_BUDGET, fit_blocks

    bf16, f32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert fit_blocks(MK.DOWN_BLOCKS, bf16, bf16) == MK.DOWN_BLOCKS
    assert fit_blocks(LATENT_BLOCKS, bf16, f32) == LATENT_BLOCKS  # fp32 activations on bf16 weights: 192 KB
    assert fit_blocks(MK.DOWN_BLOCKS, f32, f32) is None
    assert fit_blocks(None, f32, f32) is None and fit_blocks({}, f32, f32) == {}
    assert SMEM_BUDGET < 227 * 1024
