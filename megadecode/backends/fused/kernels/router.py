"""The MoE router as one Triton kernel: scores, selection bias, expert groups, top-k, renormalisation,
scaling, for a block of tokens per program. Math in fp32 whatever the input dtype; the routing rules are the
ones stated in reference/moe.py:

  softmax: p = softmax(x W^T); pick the A largest p; weights = p / sum(picked p) when norm_topk_prob.
  sigmoid: s = sigmoid(x W^T); choice = s + bias; groups: a group's score is the sum of its 2 best
      choices, the topk_group best groups stay; pick the A largest choice among them;
      weights = s / (sum(picked s) + 1e-20) when norm_topk_prob, times routed_scaling_factor.
  ties: the lower index wins, for experts and for groups.

Dimensions: T tokens, D hidden, E experts, A = top_k, G groups of E/G experts.

Two launches by default (`split=True`): the logits x W^T fp32 by the tensor-core projection of
backends/fused/kernels/linear.py (`linear_partials`: programs over expert tiles and K chunks, so the router weight is
streamed by ~one program per SM, not by the one program that holds a token block), then the selection kernel
adding the chunks' partial sums in order (PRESCORED). The chunking depends on E, D and the GPU, not on the
batch, so a token's route does not depend on the other tokens of the step. `split=False` keeps the single kernel that also computes the logits (fp32 FMA, one program per
token block reads the whole router weight: slow at decode batch sizes, measured on the H200 in
docs/evidence/triton-router-h200.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....config import ModelConfig
from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ROUTER
from .linear import audit_specs as linear_specs
from .linear import linear_partials
from .splitk import num_sms


@triton.jit
def _pick_max(values, idx, BIG: tl.constexpr):
    """Per row of values [BLOCK_T, N]: (max value, the lowest index holding it)."""
    m = tl.max(values, axis=1)
    return m, tl.min(tl.where(values == m[:, None], idx[None, :], BIG), axis=1)


@triton.jit
def router_kernel(x_ptr, w_ptr, bias_ptr, ids_ptr, wts_ptr, s_ptr, T, stride_x, stride_w, scale,
                  D: tl.constexpr, E: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  G: tl.constexpr, TOPK_GROUP: tl.constexpr, A: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_G: tl.constexpr,
                  PRESCORED: tl.constexpr = False, KS: tl.constexpr = 1):
    """BLOCK_T tokens per program; every reduction is per token (row), so results do not depend on
    which other tokens share the program (batch invariance). PRESCORED: the logits come from s_ptr [T, E] fp32
    (computed by an earlier launch) instead of the D loop, as KS partial sums [KS, T, E] added in order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if PRESCORED:
        for ks in tl.static_range(KS):
            logits += tl.load(s_ptr + (ks * T + t[:, None].to(tl.int64)) * E + e[None, :],
                              mask=t_ok[:, None] & e_ok[None, :], other=0.0)
    for d0 in range(0, D if not PRESCORED else 0, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * stride_w + d[None, :], mask=e_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        logits += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    neg_inf = float("-inf")
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    else:
        lg = tl.where(e_ok[None, :], logits, neg_inf)
        p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
        choice = scores
    choice = tl.where(e_ok[None, :], choice, neg_inf)
    if G > 1:  # keep the TOPK_GROUP groups with the best top-2 sums (ties: the lower group wins)
        GS: tl.constexpr = E // G
        g_idx = tl.arange(0, BLOCK_G)
        g_score = tl.full((BLOCK_T, BLOCK_G), neg_inf, dtype=tl.float32)
        for g in tl.static_range(G):
            in_g = ((e >= g * GS) & (e < (g + 1) * GS))[None, :]
            c = tl.where(in_g, choice, neg_inf)
            m1, i1 = _pick_max(c, e, BLOCK_E)
            m2 = tl.max(tl.where(e[None, :] == i1[:, None], neg_inf, c), axis=1)
            g_score = tl.where(g_idx[None, :] == g, (m1 + m2)[:, None], g_score)
        keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for j in tl.static_range(TOPK_GROUP):
            _, gi = _pick_max(g_score, g_idx, BLOCK_G)
            keep = keep | ((e[None, :] >= gi[:, None] * GS) & (e[None, :] < (gi[:, None] + 1) * GS))
            g_score = tl.where(g_idx[None, :] == gi[:, None], neg_inf, g_score)
        choice = tl.where(keep, choice, neg_inf)
    a_idx = tl.arange(0, BLOCK_A)
    ids = tl.zeros((BLOCK_T, BLOCK_A), dtype=tl.int64)
    wts = tl.zeros((BLOCK_T, BLOCK_A), dtype=tl.float32)
    for a in tl.static_range(A):  # top-k by repeated arg-max: the lower index wins ties
        _, i = _pick_max(choice, e, BLOCK_E)
        hit = e[None, :] == i[:, None]
        ids = tl.where(a_idx[None, :] == a, i.to(tl.int64)[:, None], ids)
        wts = tl.where(a_idx[None, :] == a, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], wts)
        choice = tl.where(hit, neg_inf, choice)
    if NORM:
        if SIGMOID:
            wts = wts / (tl.sum(wts, axis=1)[:, None] + 1e-20)
        else:
            wts = wts / tl.sum(wts, axis=1)[:, None]
    wts = wts * scale
    ok = t_ok[:, None] & (a_idx < A)[None, :]
    offs = t[:, None] * A + a_idx[None, :]
    tl.store(ids_ptr + offs, ids, mask=ok)
    tl.store(wts_ptr + offs, wts, mask=ok)


def route_triton(cfg: ModelConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None,
                 ids: torch.Tensor, weights: torch.Tensor, split: bool = True) -> None:
    """x [T, D], gate_w [E, D], bias [E] or None -> writes ids [T, A] int64 and weights [T, A] fp32.
    split: logits by the tensor-core projection first (two launches), else all in one kernel."""
    T, D = x.shape
    E, A = cfg.num_experts, cfg.top_k
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, D] with unit stride over D, got {x.stride()}"
    assert gate_w.shape == (E, D) and gate_w.stride(1) == 1, f"gate_w {tuple(gate_w.shape)} != {(E, D)}"
    assert gate_w.dtype == x.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16), \
        f"x {x.dtype} and gate_w {gate_w.dtype} must share a float dtype"
    sigmoid = cfg.score_func == "sigmoid"
    if bias is not None:
        assert sigmoid and bias.shape == (E,) and bias.is_contiguous(), "bias: [E] contiguous, sigmoid only"
    assert ids.shape == (T, A) and ids.dtype == torch.int64 and ids.is_contiguous(), "ids: [T, A] int64"
    assert weights.shape == (T, A) and weights.dtype == torch.float32 and weights.is_contiguous(), \
        "weights: [T, A] fp32"
    assert len({t.device for t in (x, gate_w, ids, weights)}) == 1, "all tensors on one device"
    if T == 0:
        return
    BE = triton.next_power_of_2(E)
    block_t = min(16, triton.next_power_of_2(T), max(1, 4096 // BE))  # [BLOCK_T, E] scores <= 4096
    block_d = max(1, min(triton.next_power_of_2(D), 8192 // (BE * block_t)))  # x*w tile <= 8192 values
    scores = ids  # unused pointer unless split
    if split:
        # the logits as K-chunk partial sums, so that a batch-1 step streams gate_w with ~1 program per SM; the
        # chunking depends on E, D and the GPU only, not on T: a token's logits do not depend on the batch
        ks = max(1, min(16, num_sms(x.device) // triton.cdiv(E, 64)))
        scores = linear_partials(x, gate_w, ks)  # [KS, T, E] fp32
        block_d = 1
    router_kernel[(triton.cdiv(T, block_t),)](
        x, gate_w, bias if bias is not None else gate_w, ids, weights, scores, T, x.stride(0), gate_w.stride(0),
        float(cfg.routed_scaling_factor) if sigmoid else 1.0,
        D=D, E=E, SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORM=cfg.norm_topk_prob, G=cfg.n_group,
        TOPK_GROUP=cfg.topk_group, A=A, BLOCK_T=block_t, BLOCK_E=BE, BLOCK_D=block_d,
        BLOCK_A=triton.next_power_of_2(A), BLOCK_G=triton.next_power_of_2(cfg.n_group), PRESCORED=split,
        KS=scores.shape[0] if split else 1)


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    bias = weights[op.weights[1]] if len(op.weights) > 1 else None
    route_triton(cfg, inputs[op.inputs[0]], weights[op.weights[0]], bias, outputs["topk_ids"],
                 outputs["topk_weights"])


def audit_specs(dtype: str = "bf16", D: int = 7168, E: int = 256, A: int = 8, prescored: tuple = (True,)) -> list:
    """The selection kernel at every routing form the configs select (softmax; sigmoid with a selection bias,
    without and with expert groups) x renormalisation on/off, after the K-chunk logits (PRESCORED, the
    launcher's default `split=True`; `prescored=(False, True)` adds the one-kernel form), and the logits'
    linear_kernel. Path constexprs: the booleans and G (1 or more groups)."""
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32",
           "s_ptr": "*fp32", "T": "i32", "stride_x": "i32", "stride_w": "i32", "scale": "fp32"}
    specs = []
    for sigmoid, groups in ((False, 1), (True, 1), (True, 8)):
        for norm in (True, False):
            for pre in prescored:
                consts = {"D": D, "E": E, "SIGMOID": sigmoid, "HAS_BIAS": sigmoid, "NORM": norm, "G": groups,
                          "TOPK_GROUP": min(groups, 4), "A": A, "BLOCK_T": 16, "BLOCK_E": triton.next_power_of_2(E),
                          "BLOCK_D": 1 if pre else 64, "BLOCK_A": triton.next_power_of_2(A),
                          "BLOCK_G": triton.next_power_of_2(groups), "PRESCORED": pre, "KS": 8 if pre else 1}
                specs.append(kernel_spec(router_kernel, sig, consts, static=("w_ptr", "bias_ptr"),
                                         path=("SIGMOID", "HAS_BIAS", "NORM", "G", "PRESCORED")))
    return specs + linear_specs(dtype, norm=False, K=D, N=E, x_dtype=dtype, partials=True)


# one program holds all E scores of a token; the group loop is unrolled
LIMITS = (("num_experts", 1, 1024), ("n_group", 1, 16))


ROUTER_VARIANT = register(Variant(Manifest(
    name="triton-router",
    description="router in Triton: logits by a tensor-core projection over expert tiles, then one kernel (a "
                "block of tokens per program) for scores, bias, groups, top-k (lowest index wins), renormalise, "
                "scale; fp32 math",
    replaces=(ROUTER,), scope=Scope(families=("qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3"), limits=LIMITS),
    sources=("megadecode/backends/fused/kernels/router.py", "megadecode/backends/fused/kernels/linear.py", "megadecode/backends/fused/kernels/common.py"), uses_triton=True,
    kernels=audit_specs),
    _run, kernel=router_kernel))
