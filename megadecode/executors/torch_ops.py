"""The reference implementation of each plan op kind, over a context of named buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import plan as P
from ..reference.attention import gqa_attention, mla_attention
from ..reference.kda import kda_attention
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


def _lm_head(ctx, op):
    ctx.buf["logits"] = F.linear(ctx.buf[op.inputs[0]], ctx.w[op.weights[0]]).float()


OP_IMPLS: dict[str, Callable] = {
    P.EMBED: _embed, P.RMSNORM: _rmsnorm, P.ADD: _add, P.ATTN_GQA: _attn_gqa, P.ATTN_MLA: _attn_mla,
    P.ATTN_KDA: _attn_kda,    P.ROUTER: _router, P.EXPERTS: _experts, P.MLP: _mlp, P.LM_HEAD: _lm_head,
}
