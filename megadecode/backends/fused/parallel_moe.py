"""The fused executor's MoE ops under expert parallelism: the chosen Triton variant over this rank's experts
(the router's ids turned into local ids, -1 for the other ranks' pairs, which the kernels skip), its fp32 partial
sum combined over the ranks (parallel/combine.py), then cast. The torch and graph executors do the same inside the
reference ops (torch_ops `_experts`, `_latent_moe`)."""

from __future__ import annotations

import torch

from ...plan import EXPERTS, LATENT_MOE
from ...quant.mxfp4 import MXFP4Tensor
from ..torch.ops import OP_IMPLS

KINDS = (EXPERTS, LATENT_MOE)


def run(ex, variant, op, ctx, step) -> None:
    """One EXPERTS or LATENT_MOE op of executor `ex` (its `parallel` set) with `variant` (None: the reference op)."""
    ep = ex.parallel
    x, ids, wts = (ctx.buf[n] for n in op.inputs)
    if variant is None or (op.kind == LATENT_MOE and variant.name != "triton-latent-moe"):
        OP_IMPLS[op.kind](ctx, op)
        return
    local = ep.local_ids(ids)
    if op.kind == EXPERTS:
        partial = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        variant.run(op, {op.inputs[0]: x, op.inputs[1]: local, op.inputs[2]: wts},
                    {n: ex.weights[n] for n in op.weights}, {op.outputs[0]: partial}, ex.cfg, step)
        ctx.buf[op.outputs[0]] = ep.combine(partial).to(x.dtype)
        return
    from .kernels.latent_moe import latent_moe

    down_w, gu_p, gu_s, dn_p, dn_s, norm_w, up_w = (ex.weights[n] for n in op.weights)
    ctx.buf[op.outputs[0]] = latent_moe(x, local, wts, down_w, MXFP4Tensor(gu_p, gu_s), MXFP4Tensor(dn_p, dn_s),
                                        norm_w, up_w, act=ex.cfg.expert_act, eps=ex.cfg.rms_norm_eps,
                                        combine=ep.combine)
