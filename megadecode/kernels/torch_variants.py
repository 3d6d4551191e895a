"""Plain-torch variants: the sync-free grouped experts and the reference GQA attention, in the variant
contract (write preallocated outputs in place). They are the baselines the broken variants modify."""

from __future__ import annotations

from ..plan import ATTN_GQA, EXPERTS
from ..reference.attention import gqa_attention
from ..reference.moe import experts_grouped
from ..reference.rope import rope_cos_sin
from ..validate.variant import Manifest, Scope, Variant, register


def _grouped_experts(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    outputs[op.outputs[0]].copy_(experts_grouped(x, ids, wts, weights[op.weights[0]], weights[op.weights[1]]))


def attn_gqa(op, inputs, weights, outputs, cfg, step, cache):
    """Writes the new tokens' keys/values into `cache` and attention into outputs['attn_out']."""
    x = inputs["normed"]
    k, v = cache
    w = {n: weights[n] for n in op.weights}
    y = gqa_attention(cfg, w, f"model.layers.{op.layer}.self_attn", x, step,
                      rope_cos_sin(cfg, step.positions, x.dtype), k, v)
    outputs[op.outputs[0]].copy_(y)


GROUPED_EXPERTS = register(Variant(Manifest(
    name="torch-grouped-experts",
    description="routed experts as two torch._grouped_mm over expert-sorted pairs (reference/moe.py "
                "experts_grouped), no host sync",
    replaces=(EXPERTS,), scope=Scope(dtypes=("float32", "bfloat16")),  # _grouped_mm: no fp16 on cpu
    sources=("megadecode/reference/moe.py", "megadecode/kernels/torch_variants.py")), _grouped_experts))

ATTN_GQA_TORCH = register(Variant(Manifest(
    name="torch-attn-gqa", description="GQA attention of reference/attention.py in the variant contract",
    replaces=(ATTN_GQA,), scope=Scope(families=("qwen3_moe",)),
    sources=("megadecode/reference/attention.py", "megadecode/kernels/torch_variants.py")), attn_gqa))
