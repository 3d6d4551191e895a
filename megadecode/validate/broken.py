"""Deliberately broken variants (`broken-*`): each a small modification of a correct one, planting one
classic bug. The harness must flag every one of them (tests/test_validate.py), and none of the correct ones.

  broken-router-tie-high        top-k ties: the higher expert index wins (router on reversed experts)
  broken-router-no-renorm       picked weights not renormalised
  broken-router-renorm-after-scale  renormalised after routed_scaling_factor (the factor is lost;
                                visible only where the factor != 1, e.g. DeepSeek-V3)
  broken-router-noise           nondeterministic: tiny random noise (1e-7) on the weights each run
  broken-rmsnorm-last-row       partial write: the launch covers all rows but the last
  broken-rmsnorm-batch67        a bug at one batch size only: at 67 tokens, row 66 gets row 65's values
  broken-rmsnorm-scratch-input  uses its input buffer as scratch (mutates an input)
  broken-experts-offsets        per-expert offsets shifted by one pair (each expert's last pair runs
                                through the next expert)
  broken-attn-stale-cache       attention that leaves the last token's old cache entry in place
                                (this step's output is right; the cache is stale for the next step)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..contract import Variant, register
from ..kernels import rmsnorm as K_NORM
from ..kernels import router as K_ROUTER
from . import torch_variants as K_TORCH


def _broken(base: Variant, name: str, description: str, impl) -> Variant:
    m = base.manifest
    return register(Variant(replace(m, name=name, description=description,
                                    sources=m.sources + ("megadecode/validate/broken.py",)), impl, base.kernel))


def _route(cfg, op, inputs, weights, outputs):
    bias = weights[op.weights[1]] if len(op.weights) > 1 else None
    K_ROUTER.route_triton(cfg, inputs[op.inputs[0]], weights[op.weights[0]], bias, outputs["topk_ids"],
                          outputs["topk_weights"])


def _tie_high(op, inputs, weights, outputs, cfg, step, cache=None):
    rev = {n: w.flip(0).contiguous() for n, w in weights.items()}  # expert e -> E-1-e (groups reverse too)
    _route(cfg, op, inputs, rev, outputs)
    ids = outputs["topk_ids"]
    ids.neg_().add_(cfg.num_experts - 1)


def _no_renorm(op, inputs, weights, outputs, cfg, step, cache=None):
    _route(replace(cfg, norm_topk_prob=False), op, inputs, weights, outputs)


def _renorm_after_scale(op, inputs, weights, outputs, cfg, step, cache=None):
    _route(replace(cfg, norm_topk_prob=False), op, inputs, weights, outputs)
    w = outputs["topk_weights"]
    w.div_(w.sum(-1, keepdim=True))


def _noise(op, inputs, weights, outputs, cfg, step, cache=None):
    _route(cfg, op, inputs, weights, outputs)
    w = outputs["topk_weights"]
    w.add_(torch.randn_like(w) * 1e-7)


def _norm_args(op, inputs, weights, outputs, cfg):
    return K_NORM.gather_rows(op, inputs), weights[op.weights[0]], cfg.rms_norm_eps, outputs[op.outputs[0]]


def _last_row(op, inputs, weights, outputs, cfg, step, cache=None):
    x, w, eps, out = _norm_args(op, inputs, weights, outputs, cfg)
    K_NORM.rms_norm_triton(x, w, eps, out, rows=x.shape[0] - 1)


def _batch67(op, inputs, weights, outputs, cfg, step, cache=None):
    x, w, eps, out = _norm_args(op, inputs, weights, outputs, cfg)
    K_NORM.rms_norm_triton(x, w, eps, out)
    if x.shape[0] == 67:
        out[66].copy_(out[65])


def _scratch_input(op, inputs, weights, outputs, cfg, step, cache=None):
    x, w, eps, out = _norm_args(op, inputs, weights, outputs, cfg)
    xf = x.float()
    x.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))  # normalised in place: x is an input
    out.copy_(w * x)


def _shifted_offsets(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    order, offs = K_TORCH.expert_offsets(ids, cfg.num_experts)
    shifted = (offs - 1).clamp(min=0)
    shifted[-1] = offs[-1]
    outputs[op.outputs[0]].copy_(K_TORCH.experts_by_offsets(x, ids, wts, weights[op.weights[0]],
                                                            weights[op.weights[1]], order, shifted))


def _stale_cache(op, inputs, weights, outputs, cfg, step, cache):
    n = step.num_tokens - 1
    slot, pos = int(step.slots[n]), int(step.positions[n])
    old = [c[slot, pos].clone() for c in cache]
    K_TORCH.attn_gqa(op, inputs, weights, outputs, cfg, step, cache)
    for c, o in zip(cache, old):
        c[slot, pos] = o


BROKEN: list[Variant] = [
    _broken(K_ROUTER.ROUTER_VARIANT, "broken-router-tie-high", "router whose top-k ties go to the higher index",
            _tie_high),
    _broken(K_ROUTER.ROUTER_VARIANT, "broken-router-no-renorm", "router without renormalisation", _no_renorm),
    _broken(K_ROUTER.ROUTER_VARIANT, "broken-router-renorm-after-scale",
            "router renormalising after the scaling (drops routed_scaling_factor)", _renorm_after_scale),
    _broken(K_ROUTER.ROUTER_VARIANT, "broken-router-noise", "router with 1e-7 random noise per run", _noise),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-last-row", "RMSNorm leaving the last row unwritten",
            _last_row),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-batch67", "RMSNorm with a wrong row at batch 67 only",
            _batch67),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-scratch-input", "RMSNorm using its input as scratch",
            _scratch_input),
    _broken(K_TORCH.LOOP_EXPERTS, "broken-experts-offsets", "loop experts with offsets shifted by one pair",
            _shifted_offsets),
    _broken(K_TORCH.ATTN_GQA_TORCH, "broken-attn-stale-cache",
            "GQA attention that keeps the last token's stale cache entry", _stale_cache),
]
