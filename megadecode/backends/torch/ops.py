"""The reference implementation of each plan op kind, over a context of named buffers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ... import plan as P
from ...quant.fp8 import FP8Tensor
from ...quant.mxfp4 import MXFP4Tensor
from ...reference.attention import gqa_attention, mla_attention
from ...reference.attn_res import attn_res
from ...reference.kda import kda_attention
from ...reference.latent_moe import latent_experts
from ...reference.moe import experts_grouped, experts_reference
from ...reference.norm import rms_norm, swiglu_mlp
from ...reference.rope import rope_cos_sin
from ...reference.routing import route


class StepContext:
    """Buffers of one step: step inputs, activations, plus the weights and the cache they use.

    `experts_impl`: "reference" (loops with host syncs: the torch executor's reference) or "grouped"
    (sync-free: EXPERTS ops use torch._grouped_mm; K3's LATENT_MOE decode steps use the Triton routed
    experts, see `_latent_routed`).
    `parallel` (megadecode.parallel.combine.ExpertParallel, None for one process): the routed experts held here are
    this rank's shard; MoE ops sum their local experts' contributions (the others' pairs have id -1) in fp32 and
    combine the ranks' partial sums (the layer's only communication)."""

    def __init__(self, cfg, weights, cache, step, experts_impl: str = "reference", parallel=None):
        self.cfg, self.w, self.cache, self.step = cfg, weights, cache, step
        self.experts_impl = experts_impl
        self.parallel = parallel
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


def expert_weights(cfg, weights: dict, op) -> tuple:
    """(gate_up, down) of an EXPERTS op: float stacks, or FP8Tensors (values + block scales, plan.py)."""
    w = [weights[n] for n in op.weights]
    if len(w) == 4:
        return FP8Tensor(w[0], w[1], cfg.weight_block), FP8Tensor(w[2], w[3], cfg.weight_block)
    return w[0], w[1]


def _experts(ctx, op):
    """Routed experts. FP8 experts in the graph executor's decode steps: the Triton kernels
    (backends/fused/kernels/fp8_experts.py, sync-free) when Triton can run; otherwise the reference ops. Expert parallelism: the
    local experts' fp32 partial sum, combined over the ranks, then cast."""
    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    gate_up, down = expert_weights(ctx.cfg, ctx.w, op)
    ep = ctx.parallel
    if ep is not None:
        ids = ep.local_ids(ids)
    dt = x.dtype if ep is None else torch.float32  # a partial sum stays fp32 until the ranks' are added
    out = None
    if isinstance(gate_up, FP8Tensor) and ctx.experts_impl == "grouped" and ctx.step.segments is None:
        mod = _triton_module(x.device, "fp8_experts", ("fp8_up_kernel",))
        if mod is not None:
            out = mod.fp8_experts(x.contiguous(), ids.contiguous(), wts.float().contiguous(), gate_up, down,
                                  out=torch.empty(x.shape, dtype=dt, device=x.device))
    if out is None:
        fn = experts_reference if ctx.experts_impl == "reference" else experts_grouped
        out = fn(x, ids, wts, gate_up, down, out_dtype=dt)
    ctx.buf[op.outputs[0]] = out if ep is None else ep.combine(out).to(x.dtype)


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


def _triton_module(device: torch.device, module: str, kernels: tuple[str, ...]):
    """megadecode.backends.fused.kernels.<module> when Triton can run its `kernels` on `device`, else None. On CUDA: when triton
    imports. On the CPU: only under the Triton interpreter, i.e. the kernels were decorated with
    TRITON_INTERPRET=1 (never imports Triton on the CPU without it: that would break the interpreter for the rest
    of the process)."""
    name = f"megadecode.backends.fused.kernels.{module}"
    if device.type == "cpu" and name not in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if device.type not in ("cpu", "cuda"):
        return None
    import importlib

    mod = importlib.import_module(name)  # on CUDA without triton: ModuleNotFoundError (the CLI says how to install)
    from ...contract import triton_interpreted

    if device.type == "cpu" and not all(triton_interpreted(k) for k in _kernel_objects(mod, kernels)):
        return None
    return mod


def _kernel_objects(mod, names: tuple[str, ...]) -> list:
    out = []
    for n in names:
        obj = mod
        for part in n.split("."):
            obj = getattr(obj, part)
        out.append(obj)
    return out


def _triton_experts_fn(device: torch.device):
    """megadecode.backends.fused.kernels.grouped_experts.routed_experts (the small-batch fused kernels for <= 16 tokens,
    the grouped kernels above) when Triton can run it on `device` (`_triton_module`), else None."""
    mod = _triton_module(device, "grouped_experts", ("grouped_up_kernel", "fe.experts_up_kernel"))
    return None if mod is None else mod.routed_experts


def _latent_routed(ctx, h, ids, wts, gate_up: MXFP4Tensor, down: MXFP4Tensor) -> torch.Tensor:
    """z = sum_a wts[t, a] * Expert_{ids[t, a]}(h[t]) in fp32 (h [T, R] fp32).

    experts_impl "grouped" (graph executor), a decode step (no prefill segments) and Triton able to run:
    the Triton routed experts (MXFP4 decoded in registers, no host sync: capturable; fused kernels at
    <= 16 tokens, grouped by expert above). Otherwise the reference loop over the selected experts (host
    syncs): the torch executor always, and prefill (eager) in the graph executor."""
    if ctx.experts_impl == "grouped" and ctx.step.segments is None:
        fn = _triton_experts_fn(h.device)
        if fn is not None:
            return fn(h.contiguous(), ids.contiguous(), wts.float().contiguous(), gate_up, down,
                      act=ctx.cfg.expert_act)
    return latent_experts(h, ids, wts, gate_up, down, ctx.cfg.expert_act)


def _latent_moe(ctx, op):
    """Stable LatentMoE's routed half (reference/latent_moe.py): latent down, the selected MXFP4 experts
    (reference: decoded exactly one at a time; graph decode: the Triton kernels, see `_latent_routed`),
    RMSNorm of the weighted sum, latent up. fp32 inside. Expert parallelism: the weighted sum over the local
    experts, combined over the ranks before the norm (the norm is of the whole sum)."""
    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    down_w, gu_p, gu_s, dn_p, dn_s, norm_w, up_w = (ctx.w[n] for n in op.weights)
    h = F.linear(x.float(), down_w.float())
    ep = ctx.parallel
    z = _latent_routed(ctx, h, ids if ep is None else ep.local_ids(ids), wts, MXFP4Tensor(gu_p, gu_s),
                       MXFP4Tensor(dn_p, dn_s))
    if ep is not None:
        z = ep.combine(z)
    z = rms_norm(z, norm_w.float(), ctx.cfg.rms_norm_eps)
    ctx.buf[op.outputs[0]] = F.linear(z, up_w.float()).to(x.dtype)


def _lm_head(ctx, op):
    """The logits; under expert parallelism with the lm_head split by rows (parallel/vocab.py), this rank's slice
    and one all-gather of the others'."""
    w = ctx.w[op.weights[0]]
    logits = F.linear(ctx.buf[op.inputs[0]], w).float()
    if ctx.parallel is not None and w.shape[0] != ctx.cfg.vocab_size:  # weights.vocab_shard's rows
        logits = ctx.parallel.gather_logits(logits, ctx.cfg.vocab_size)
    ctx.buf["logits"] = logits


def _add_rmsnorm(ctx, op):
    """The composite of fuse_add_rmsnorm: ADD then RMSNORM, exactly as the two reference ops."""
    _add(ctx, P.Op(P.ADD, op.layer, op.inputs, op.outputs[:1]))
    _rmsnorm(ctx, P.Op(P.RMSNORM, op.layer, op.outputs[:1], op.outputs[1:], op.weights))


OP_IMPLS: dict[str, Callable] = {
    P.EMBED: _embed, P.RMSNORM: _rmsnorm, P.ADD: _add, P.ATTN_GQA: _attn_gqa, P.ATTN_MLA: _attn_mla,
    P.ATTN_KDA: _attn_kda, P.ROUTER: _router, P.EXPERTS: _experts, P.MLP: _mlp, P.LM_HEAD: _lm_head,
    P.ATTN_RES: _attn_res, P.LATENT_MOE: _latent_moe, P.ADD_RMSNORM: _add_rmsnorm,
}
