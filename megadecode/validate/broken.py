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
One per gap the harness used to have (issue 12), each caught by what closed it:
  broken-rmsnorm-mask-overrun   store mask d <= D: one element past each row at non-power-of-two hidden
                                (odd-dims cases; the guard regions)
  broken-rmsnorm-pow2-mean      mean over BLOCK_D, not D: wrong only at non-power-of-two hidden (odd-dims)
  broken-rmsnorm-sumsq16        16-bit sum of squares: fp16 overflows on large rows (magnitude-large)
  broken-rmsnorm-eps-outside    x / (sqrt(mean) + eps): wrong only on rows of tiny norm (magnitude-tiny)
  broken-rmsnorm-eps-sign       rsqrt(mean - eps): NaN on tiny rows, reported as computed, not as poison left
  broken-rmsnorm-nc-load        renamed RMSNorm reading x through ld.global.nc: right numbers, caught by the
                                static audit, which keys on the declared kernels in every mode, not on names
  broken-router-undeclared-path the router's one-kernel form (split=False): a specialization its manifest does
                                not declare, so never audited (the launch check)
  broken-mla-merge              MLA whose split-over-cache merge forgets to rescale the chunks by exp(m_s - M):
                                wrong only when the cache spans several chunks (long-cache cases)
  broken-attn-arange-slots      GQA attention assuming slot n for token n: wrong only with permuted slots
  broken-experts-scale          experts output scaled by 1.05: caught in bf16 as in fp32 (derived tolerances)
  broken-mlp-gelu               dense MLP with GELU instead of SiLU: an MLP op can be validated at all (builders)
  broken-experts-atomic         experts combined by a scatter-add (index_add_: atomics on the GPU, in whatever
                                order they land): deterministic on the CPU, caught by the GPU's repeat checks
One per blind spot of issue 39:
  broken-kda-eps-outside        KDA (triton-kda-decode) whose l2norm of q and k computes x / (sqrt(sum x^2) + eps):
                                wrong only where q and k have a tiny norm (KDA's magnitude-tiny cases)
  broken-attn-res-pad-zero      AttnRes (triton-attn-res) whose score vector, padded to a power of two, holds 0 in
                                the padded lanes instead of -inf: they take softmax mass; right at 2 sources (the
                                tiny preset's op), wrong at 3, 5 and 7 (the sources cases)
  broken-lm-head-logprob-shift  lm_head (triton-lm-head) whose logprobs leave out the max shift: l[token] -
                                log sum exp(l - M), M never subtracted back; the logits and tokens are right (the
                                side outputs' comparison)
  broken-lm-head-scratch-mask   lm_head whose tile partials are stored without the token mask: the rows of the last
                                16-token chunk past the batch land past the end of its scratch buffers (their guard
                                regions: Manifest.scratch), all its outputs right
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from ..contract import Variant, register
from ..backends.fused.kernels import attn_res as K_ATTN_RES
from ..backends.fused.kernels import kda as K_KDA
from ..backends.fused.kernels import lm_head as K_LM_HEAD
from ..backends.fused.kernels import mla as K_MLA
from ..backends.fused.kernels import rmsnorm as K_NORM
from ..backends.fused.kernels import router as K_ROUTER
from ..reference.attention import mla_attention
from ..reference.kda import kda_attention
from ..sampling import SamplingParams
from . import broken_kernels as K_MUT
from . import torch_variants as K_TORCH


def _broken(base: Variant, name: str, description: str, impl, kernels=None, dtypes=None) -> Variant:
    """A copy of `base` running `impl`; `kernels`: its own kernel declaration (else the base's); `dtypes`: a narrower
    scope than the base's."""
    m = base.manifest
    extra = {} if kernels is None else {"kernels": kernels, "uses_triton": True}
    if dtypes is not None:
        extra["scope"] = replace(m.scope, dtypes=dtypes)
    kernel = base.kernel if kernels is None else None
    return register(Variant(replace(m, name=name, description=description,
                                    sources=m.sources + ("megadecode/validate/broken.py",), **extra), impl, kernel))


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


def _mutant(**planted):
    def run(op, inputs, weights, outputs, cfg, step, cache=None):
        x, w, eps, out = _norm_args(op, inputs, weights, outputs, cfg)
        K_MUT.rms_norm_mutant(x, w, eps, out, **planted)
    return run


def _router_one_kernel(op, inputs, weights, outputs, cfg, step, cache=None):
    bias = weights[op.weights[1]] if len(op.weights) > 1 else None
    K_ROUTER.route_triton(cfg, inputs[op.inputs[0]], weights[op.weights[0]], bias, outputs["topk_ids"],
                          outputs["topk_weights"], split=False)


def _mla_core_no_rescale(q_lat, q_pe, latent_cache, step, scale, block_h: int = 16, block_l: int = 32):
    """backends/fused/kernels/mla.py mla_decode_core with a merge that adds the chunks' partial sums as they are: right when
    one chunk holds the whole cache, wrong when several do (their running maxima differ)."""
    N, H, C = q_lat.shape
    R = q_pe.shape[-1]
    rows = torch.arange(N, device=q_lat.device) if step.contiguous_slots else step.slots
    dt = latent_cache.dtype
    hb = -(-H // block_h)
    S, chunk = K_MLA.split_plan(N * hb, step.kv_len, block_l, q_lat.device)
    m, l, acc = K_MLA.partials(N * H, S, C, q_lat.device)
    K_MLA.mla_split_kernel[(N, hb, S)](
        q_lat.to(dt).contiguous(), q_pe.to(dt).contiguous(), latent_cache, rows.contiguous(),
        step.positions.contiguous(), m, l, acc, latent_cache.stride(0), latent_cache.stride(1), float(scale), S, chunk,
        H=H, C=C, R=R, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_C=max(16, triton.next_power_of_2(C)),
        BLOCK_R=max(16, triton.next_power_of_2(R)), IEEE=dt == torch.float32)
    return (acc.sum(1) / l.sum(1)[:, None]).view(N, H, C)


def _mla_merge(op, inputs, weights, outputs, cfg, step, cache=None):
    from ..reference.rope import rope_cos_sin

    x = inputs[op.inputs[0]]
    rope = rope_cos_sin(cfg, step.positions, x.dtype) if cfg.mla_rope else None
    outputs[op.outputs[0]].copy_(mla_attention(cfg, weights, f"model.layers.{op.layer}.self_attn", x, step, rope,
                                               cache[0], core=_mla_core_no_rescale))


def _arange_slots(op, inputs, weights, outputs, cfg, step, cache):
    n = step.num_tokens
    K_TORCH.attn_gqa(op, inputs, weights, outputs, cfg,
                     replace(step, slots=torch.arange(n, device=step.slots.device), contiguous_slots=True), cache)


def _scaled_experts(op, inputs, weights, outputs, cfg, step, cache=None):
    K_TORCH.GROUPED_EXPERTS.run(op, inputs, weights, outputs, cfg, step)
    outputs[op.outputs[0]].mul_(1.05)


def _mlp_gelu(op, inputs, weights, outputs, cfg, step, cache=None):
    x = inputs[op.inputs[0]].float()
    gate, up, down = (weights[n].float() for n in op.weights)
    outputs[op.outputs[0]].copy_((torch.nn.functional.gelu(x @ gate.T) * (x @ up.T)) @ down.T)


def _atomic_combine(op, inputs, weights, outputs, cfg, step, cache=None):
    """Each (token, pick) pair's expert output scatter-added into the token's row in the output dtype: on the
    GPU index_add_ uses atomic adds, whose order (and so the rounding) changes from run to run."""
    x, ids, wts = (inputs[n] for n in op.inputs)
    T, A = ids.shape
    order, offs = K_TORCH.expert_offsets(ids, cfg.num_experts)
    y = torch.zeros(T * A, x.shape[1], dtype=torch.float32, device=x.device)
    ends = offs.tolist()
    gate_up, down = weights[op.weights[0]], weights[op.weights[1]]
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end > start:
            pairs = order[start:end]
            g, u = torch.nn.functional.linear(x[pairs // A], gate_up[e]).chunk(2, dim=-1)
            y[pairs] = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down[e]).float()
    out = outputs[op.outputs[0]]
    out.zero_()
    tokens = torch.arange(T, device=x.device).repeat_interleave(A)
    out.index_add_(0, tokens, (y * wts.reshape(-1, 1).float()).to(out.dtype))


def _l2norm_eps_outside(x: torch.Tensor) -> torch.Tensor:
    """KDA's l2norm with its 1e-6 added after the square root: equal to the reference unless sum x^2 is small."""
    return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)


def _kda_eps_outside(op, inputs, weights, outputs, cfg, step, cache=None):
    conv_state, rec_state = cache
    outputs[op.outputs[0]].copy_(kda_attention(cfg, weights, f"model.layers.{op.layer}.self_attn",
                                               inputs[op.inputs[0]], step, conv_state, rec_state,
                                               recur=K_KDA.kda_decode_recurrence, l2norm=_l2norm_eps_outside))


def _attn_res_pad_zero(op, inputs, weights, outputs, cfg, step, cache=None):
    """AttnRes as the kernel lays it out (scores in a vector of the next power of two of the source count, at
    least 2), with the padded lanes scored 0 where the kernel masks them to -inf."""
    hidden = inputs["hidden"]
    blocks = list(inputs["blocks"].unbind(0)) if "blocks" in op.inputs else []
    if "blocks" in op.outputs:  # the block ends: its partial sum is frozen, the next one starts at zero
        blocks.append(hidden)
        outputs["blocks"].copy_(torch.stack(blocks))
        outputs["hidden"].zero_()
        sources = torch.stack(blocks).float()
    else:
        sources = torch.stack(blocks + [hidden]).float()
    query, norm_w = (weights[n].float() for n in op.weights)
    keys = sources * torch.rsqrt(sources.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w
    scores = keys @ query  # [S, N]
    S = scores.shape[0]
    padded = torch.cat((scores, scores.new_zeros(max(2, triton.next_power_of_2(S)) - S, scores.shape[1])))
    alpha = torch.softmax(padded, dim=0)[:S]  # the padded lanes' share is lost
    outputs["layer_in"].copy_(torch.einsum("sn,snd->nd", alpha, sources))


def _logprob_no_max_shift(op, inputs, weights, outputs, cfg, step, cache=None):
    """The lm_head kernel's logits, tokens and logprobs, the logprobs then off by each row's max logit M (as if the
    merge returned l[token] - log S with S the sum of exp(l - M))."""
    K_LM_HEAD.LM_HEAD_VARIANT.run(op, inputs, weights, outputs, cfg, step, cache)
    if "logprobs" in outputs:
        outputs["logprobs"].add_(outputs[op.outputs[0]].amax(-1))


def _scratch_unmasked(op, inputs, weights, outputs, cfg, step, cache=None):
    """The lm_head kernels run over the batch padded to whole 16-token chunks, their partials written through
    [padded rows, tiles] views of the handed-in scratch ([rows, tiles]): what partial stores without the token
    mask do. The outputs keep the real rows."""
    scratch = K_LM_HEAD._scratch_of(outputs)
    if not scratch:
        return K_LM_HEAD.LM_HEAD_VARIANT.run(op, inputs, weights, outputs, cfg, step, cache)
    x = inputs[op.inputs[0]].contiguous()
    B, padded = x.shape[0], -(-x.shape[0] // K_LM_HEAD.BLOCK_B) * K_LM_HEAD.BLOCK_B
    xp = torch.cat((x, x.new_zeros(padded - B, x.shape[1])))
    wide = {n: t.as_strided((padded, t.shape[1]), (t.shape[1], 1)) for n, t in scratch.items()}
    tokens, logprobs, logits = K_LM_HEAD.lm_head_sample(xp, weights[op.weights[0]], SamplingParams(greedy=True),
                                                        scratch=wide)
    outputs[op.outputs[0]].copy_(logits[:B])
    for n, t in (("tokens", tokens), ("logprobs", logprobs)):
        if n in outputs:
            outputs[n].copy_(t[:B])


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
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-mask-overrun",
            "RMSNorm whose store mask writes one element past each row (d <= D)", _mutant(MASK_OVERRUN=True),
            lambda: K_MUT.mutant_specs(MASK_OVERRUN=True)),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-pow2-mean", "RMSNorm dividing the sum of squares by BLOCK_D",
            _mutant(POW2_MEAN=True), lambda: K_MUT.mutant_specs(POW2_MEAN=True)),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-sumsq16", "RMSNorm summing squares in the 16-bit input dtype",
            _mutant(SUMSQ_16BIT=True), lambda: K_MUT.mutant_specs(SUMSQ_16BIT=True)),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-eps-outside", "RMSNorm computing x / (sqrt(mean) + eps)",
            _mutant(EPS_OUTSIDE=True), lambda: K_MUT.mutant_specs(EPS_OUTSIDE=True)),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-eps-sign", "RMSNorm computing rsqrt(mean - eps)",
            _mutant(EPS_SIGN=True), lambda: K_MUT.mutant_specs(EPS_SIGN=True)),
    _broken(K_NORM.RMSNORM_VARIANT, "broken-rmsnorm-nc-load",
            "RMSNorm (renamed copy) reading its input through the non-coherent load path", _mutant(NC_LOAD=True),
            lambda: K_MUT.mutant_specs(NC_LOAD=True), dtypes=("float32",)),
    _broken(K_ROUTER.ROUTER_VARIANT, "broken-router-undeclared-path",
            "router launching its one-kernel form, which its manifest does not declare", _router_one_kernel),
    _broken(K_MLA.MLA_VARIANT, "broken-mla-merge", "MLA decode whose split merge skips the exp(m_s - M) rescale",
            _mla_merge),
    _broken(K_TORCH.ATTN_GQA_TORCH, "broken-attn-arange-slots", "GQA attention assuming slot n for token n",
            _arange_slots),
    _broken(K_TORCH.GROUPED_EXPERTS, "broken-experts-scale", "grouped experts with the output scaled by 1.05",
            _scaled_experts),
    _broken(K_TORCH.MLP_TORCH, "broken-mlp-gelu", "dense MLP with GELU instead of SiLU", _mlp_gelu),
    _broken(K_TORCH.LOOP_EXPERTS, "broken-experts-atomic",
            "loop experts combined by a scatter-add (atomics on the GPU, order-dependent)", _atomic_combine),
    _broken(K_KDA.KDA_VARIANT, "broken-kda-eps-outside", "KDA whose q/k l2norm adds its eps outside the sqrt",
            _kda_eps_outside),
    _broken(K_ATTN_RES.ATTN_RES_VARIANT, "broken-attn-res-pad-zero",
            "AttnRes scoring the padded lanes of its power-of-two score vector 0 instead of masking them",
            _attn_res_pad_zero),
    _broken(K_LM_HEAD.LM_HEAD_VARIANT, "broken-lm-head-logprob-shift",
            "lm_head whose logprobs leave out the max shift (off by the row's max logit)", _logprob_no_max_shift),
    _broken(K_LM_HEAD.LM_HEAD_VARIANT, "broken-lm-head-scratch-mask",
            "lm_head storing its tile partials without the token mask (past its scratch buffers)", _scratch_unmasked),
]
