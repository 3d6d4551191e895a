"""Plain-torch variants: the sync-free grouped experts, the reference GQA attention, and restatements of the ops
no kernel replaces yet (embedding lookup, residual add, dense SwiGLU MLP, Block AttnRes), in the variant contract
(write preallocated outputs in place). They are the baselines the broken variants modify, and they show that
every op kind of the plan can carry a validated variant (tests/test_validate.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contract import Manifest, Scope, Variant, float_experts, register
from ..plan import ADD, ATTN_GQA, ATTN_RES, EMBED, EXPERTS, MLP
from ..reference.attention import gqa_attention
from ..reference.moe import experts_grouped
from ..config.registry import FAMILIES
from ..reference.rope import rope_cos_sin


def _grouped_experts(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    outputs[op.outputs[0]].copy_(experts_grouped(x, ids, wts, weights[op.weights[0]], weights[op.weights[1]]))


def expert_offsets(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offs): the T*A (token, expert) pairs sorted by expert, and offs[e] = end of expert e's run."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), torch.cumsum(counts, 0)


def experts_by_offsets(x, ids, wts, gate_up, down, order, offs) -> torch.Tensor:
    """Routed experts over expert-sorted pairs: expert e runs pairs order[offs[e-1]:offs[e]] (a host loop,
    each expert's weights read once; fp32 accumulation). The combine sums each token's A results."""
    T, A = ids.shape
    y = torch.zeros(T * A, x.shape[1], dtype=torch.float32, device=x.device)
    ends = offs.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end > start:
            pairs = order[start:end]
            g, u = F.linear(x[pairs // A], gate_up[e]).chunk(2, dim=-1)
            y[pairs] = F.linear(F.silu(g) * u, down[e]).float()
    return (y.view(T, A, -1) * wts[..., None].float()).sum(1).to(x.dtype)


def _loop_experts(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    order, offs = expert_offsets(ids, cfg.num_experts)
    outputs[op.outputs[0]].copy_(experts_by_offsets(x, ids, wts, weights[op.weights[0]], weights[op.weights[1]],
                                                    order, offs))


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
    replaces=(EXPERTS,), scope=Scope(families=("qwen3_moe", "deepseek_v3"), dtypes=("float32", "bfloat16"), dims=float_experts),  # no fp16 _grouped_mm on cpu
    sources=("megadecode/reference/moe.py", "megadecode/validate/torch_variants.py")), _grouped_experts))

LOOP_EXPERTS = register(Variant(Manifest(
    name="torch-loop-experts",
    description="routed experts over expert-sorted pairs with explicit per-expert offsets, one host loop "
                "over the experts (the offset bookkeeping a grouped GEMM kernel needs)",
    replaces=(EXPERTS,), scope=Scope(families=("qwen3_moe", "deepseek_v3"), dims=float_experts), sources=("megadecode/validate/torch_variants.py",),
    graph_capturable=False),
    _loop_experts))

ATTN_GQA_TORCH = register(Variant(Manifest(
    name="torch-attn-gqa", description="GQA attention of reference/attention.py in the variant contract",
    replaces=(ATTN_GQA,), scope=Scope(families=("qwen3_moe",)),
    sources=("megadecode/reference/attention.py", "megadecode/validate/torch_variants.py")), attn_gqa))


def _embed(op, inputs, weights, outputs, cfg, step, cache=None):
    outputs[op.outputs[0]].copy_(weights[op.weights[0]].index_select(0, inputs[op.inputs[0]]))


def _add(op, inputs, weights, outputs, cfg, step, cache=None):
    torch.add(inputs[op.inputs[0]], inputs[op.inputs[1]], out=outputs[op.outputs[0]])


def _mlp(op, inputs, weights, outputs, cfg, step, cache=None):
    """SwiGLU with fp32 products, rounded once at the end (the reference rounds after each product)."""
    x = inputs[op.inputs[0]].float()
    gate, up, down = (weights[n].float() for n in op.weights)
    outputs[op.outputs[0]].copy_((F.silu(x @ gate.T) * (x @ up.T)) @ down.T)


def _attn_res(op, inputs, weights, outputs, cfg, step, cache=None):
    """Block AttnRes over explicit sources: a softmax over each source's score, fp32 (reference/attn_res.py)."""
    hidden = inputs["hidden"]
    blocks = list(inputs["blocks"].unbind(0)) if "blocks" in op.inputs else []
    if "blocks" in op.outputs:  # the block ends: its partial sum is frozen, the next one starts at zero
        blocks.append(hidden)
        outputs["blocks"].copy_(torch.stack(blocks))
        outputs["hidden"].zero_()
        sources = blocks
    else:
        sources = blocks + [hidden]
    query, norm_w = (weights[n].float() for n in op.weights)
    scores, values = [], []
    for src in sources:
        v = src.float()
        key = v / torch.sqrt(v.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w
        scores.append(key @ query)
        values.append(v)
    alpha = torch.softmax(torch.stack(scores), dim=0)  # [S, N]
    outputs["layer_in"].copy_(sum(a[:, None] * v for a, v in zip(alpha, values)))


EMBED_TORCH = register(Variant(Manifest(
    name="torch-embed", description="embedding lookup as index_select", replaces=(EMBED,), scope=Scope(families=FAMILIES),
    sources=("megadecode/validate/torch_variants.py",)), _embed))
ADD_TORCH = register(Variant(Manifest(
    name="torch-add", description="residual add as torch.add into the output", replaces=(ADD,),
    scope=Scope(families=FAMILIES), sources=("megadecode/validate/torch_variants.py",)), _add))
MLP_TORCH = register(Variant(Manifest(
    name="torch-mlp", description="dense SwiGLU MLP with fp32 products, rounded once", replaces=(MLP,),
    scope=Scope(families=FAMILIES), sources=("megadecode/validate/torch_variants.py",)), _mlp))
ATTN_RES_TORCH = register(Variant(Manifest(
    name="torch-attn-res", description="Block AttnRes over explicit sources, fp32 softmax", replaces=(ATTN_RES,),
    scope=Scope(families=("kimi_k3",)), sources=("megadecode/validate/torch_variants.py",)), _attn_res))
