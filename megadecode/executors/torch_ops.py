"""The reference implementation of each plan op kind, over a context of named buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import plan as P
from ..reference.attention import gqa_attention, mla_attention
from ..quant.mxfp4 import MXFP4Tensor
from ..reference.attn_res import attn_res
from ..reference.kda import kda_attention
from ..reference.latent_moe import latent_experts
from ..reference.moe import experts_grouped, experts_reference, route
from ..reference.norm import rms_norm, swiglu_mlp
from ..reference.rope import rope_cos_sin


class StepContext:
    """Buffers of one step: step inputs, activations, plus the weights and the cache they use."""

    def __init__(self, cfg, weights, cache, step, experts_impl: str = "reference"):
        self.cfg, self.w, self.cache, self.step = cfg, weights, cache, step
        self.experts_impl = experts_impl
        self.buf: dict[str, torch.Tensor] = {"tokens": step.tokens, "positions": step.positions,
                                             "slots": step.slots, "logit_rows": step.logit_rows}
        self._rope = None

    def rope(self, dtype):
        """cos/sin of the step's positions, computed once per step and shared by all layers."""
        if self._rope is None:
            self._rope = rope_cos_sin(self.cfg, self.step.positions, dtype)
        return self._rope


def _embed(ctx, op):
    ctx.buf["hidden"] = F.embedding(ctx.buf["tokens"], ctx.w[op.weights[0]])


def _rmsnorm(ctx, op):
    x = ctx.buf[op.inputs[0]]
    if len(op.inputs) == 2:  # the final norm only runs on the rows whose logits are wanted
        x = x[ctx.buf[op.inputs[1]]]
    ctx.buf[op.outputs[0]] = rms_norm(x, ctx.w[op.weights[0]], ctx.cfg.rms_norm_eps)


def _add(ctx, op):
    ctx.buf[op.outputs[0]] = ctx.buf[op.inputs[0]] + ctx.buf[op.inputs[1]]


def _attn_gqa(ctx, op):
    k, v = ctx.cache[op.cache]
    ctx.buf["attn_out"] = gqa_attention(ctx.cfg, ctx.w, f"model.layers.{op.layer}.self_attn",
                                        ctx.buf["normed"], ctx.step, ctx.rope(ctx.buf["normed"].dtype), k, v)


def _attn_mla(ctx, op):
    (latent,) = ctx.cache[op.cache]
    rope = ctx.rope(ctx.buf["normed"].dtype) if ctx.cfg.mla_rope else None  # kimi_linear: NoPE
    ctx.buf["attn_out"] = mla_attention(ctx.cfg, ctx.w, f"model.layers.{op.layer}.self_attn",
                                        ctx.buf["normed"], ctx.step, rope, latent)


def _attn_kda(ctx, op):
    conv_state, rec_state = ctx.cache[op.cache]
    ctx.buf["attn_out"] = kda_attention(ctx.cfg, ctx.w, f"model.layers.{op.layer}.self_attn",
                                        ctx.buf["normed"], ctx.step, conv_state, rec_state)


def _router(ctx, op):
    bias = ctx.w[op.weights[1]] if len(op.weights) > 1 else None
    ids, weights = route(ctx.cfg, ctx.buf[op.inputs[0]], ctx.w[op.weights[0]], bias)
    ctx.buf["topk_ids"], ctx.buf["topk_weights"] = ids, weights


def _experts(ctx, op):
    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    fn = experts_reference if ctx.experts_impl == "reference" else experts_grouped
    ctx.buf[op.outputs[0]] = fn(x, ids, wts, ctx.w[op.weights[0]], ctx.w[op.weights[1]])


def _mlp(ctx, op):
    gate, up, down = (ctx.w[n] for n in op.weights)
    ctx.buf[op.outputs[0]] = swiglu_mlp(ctx.buf[op.inputs[0]], gate, up, down)


def _attn_res(ctx, op):
    """Block AttnRes (reference/attn_res.py). At a block's first layer the op closes the previous block."""
    hidden = ctx.buf["hidden"]
    blocks = ctx.buf["blocks"] if "blocks" in op.inputs else None
    if "blocks" in op.outputs:
        blocks = hidden[None] if blocks is None else torch.cat((blocks, hidden[None]))
        ctx.buf["blocks"], ctx.buf["hidden"] = blocks, torch.zeros_like(hidden)
        sources = blocks  # the new block's partial sum is still empty: not a source
    else:
        sources = hidden[None] if blocks is None else torch.cat((blocks, hidden[None]))
    q, norm = (ctx.w[n] for n in op.weights)
    ctx.buf["layer_in"] = attn_res(sources, q, norm, ctx.cfg.rms_norm_eps)


def _latent_moe(ctx, op):
    """Stable LatentMoE's routed half (reference/latent_moe.py): latent down, the selected MXFP4 experts
    decoded exactly one at a time, RMSNorm of the weighted sum, latent up. fp32 inside."""
    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    down_w, gu_p, gu_s, dn_p, dn_s, norm_w, up_w = (ctx.w[n] for n in op.weights)
    h = F.linear(x.float(), down_w.float())
    z = latent_experts(h, ids, wts, MXFP4Tensor(gu_p, gu_s), MXFP4Tensor(dn_p, dn_s), ctx.cfg.expert_act)
    z = rms_norm(z, norm_w.float(), ctx.cfg.rms_norm_eps)
    ctx.buf[op.outputs[0]] = F.linear(z, up_w.float()).to(x.dtype)


def _lm_head(ctx, op):
    ctx.buf["logits"] = F.linear(ctx.buf[op.inputs[0]], ctx.w[op.weights[0]]).float()


OP_IMPLS: dict[str, Callable] = {
    P.EMBED: _embed, P.RMSNORM: _rmsnorm, P.ADD: _add, P.ATTN_GQA: _attn_gqa, P.ATTN_MLA: _attn_mla,
    P.ATTN_KDA: _attn_kda, P.ROUTER: _router, P.EXPERTS: _experts, P.MLP: _mlp, P.LM_HEAD: _lm_head,
    P.ATTN_RES: _attn_res, P.LATENT_MOE: _latent_moe,
}
