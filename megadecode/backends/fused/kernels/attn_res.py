"""Block AttnRes (kimi_k3's attention residuals, reference/attn_res.py) in one Triton kernel.

The reference builds the sources (a torch.cat of the closed blocks' sums and the partial sum), normalizes every
source row, scores it against the query, softmaxes over the sources and sums them: ~14 kernels an op on the H200
at batch 1 (bench/profile_step.py, k3-mini: ~25 us of kernel time an op and as many launch gaps in
the captured step, for a few KB of data). Here program n (a token) reads its sources' rows twice:
    score_s = query . (rmsnorm(source_s[n]) * norm.weight)    = rsqrt(mean source_s[n]^2 + eps) sum_d s q w
    alpha   = softmax_s(score)                                 over the NB closed blocks (+ the partial sum)
    out[n]  = sum_s alpha_s source_s[n]                        fp32, rounded to the sources' dtype
The number of sources is a constexpr (the plan fixes it per op). At a block's first layer the op also closes
the previous block (`blocks` grows by `hidden`, `hidden` restarts at zero): two copies and a fill, then the
kernel over the new blocks.

Memory paths: sources come from earlier launches (plain loads); query and norm weight static.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ATTN_RES


@triton.jit
def attn_res_kernel(blocks_ptr, hidden_ptr, q_ptr, w_ptr, out_ptr, N, eps, D: tl.constexpr, NB: tl.constexpr,
                    PARTIAL: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program n: out[n] = sum_s softmax(score)_s source_s[n] over blocks[0..NB) (+ hidden when PARTIAL)."""
    n = tl.program_id(0).to(tl.int64)
    S: tl.constexpr = NB + PARTIAL
    idx = tl.arange(0, S_BLOCK)
    scores = tl.full((S_BLOCK,), float("-inf"), dtype=tl.float32)
    for s in tl.static_range(S):
        if s < NB:
            row = blocks_ptr + (s * N + n) * D
        else:
            row = hidden_ptr + n * D
        ss = tl.zeros((BLOCK_D,), dtype=tl.float32)
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            ok = d < D
            v = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
            kw = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32) * tl.load(q_ptr + d, mask=ok,
                                                                               other=0.0).to(tl.float32)
            ss += v * v
            dot += v * kw
        score = tl.sum(dot, axis=0) / tl.sqrt(tl.sum(ss, axis=0) / D + eps)
        scores = tl.where(idx == s, score, scores)
    e = tl.exp(scores - tl.max(scores, axis=0))
    alpha = e / tl.sum(e, axis=0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = d < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s in tl.static_range(S):
            if s < NB:
                row = blocks_ptr + (s * N + n) * D
            else:
                row = hidden_ptr + n * D
            a = tl.sum(tl.where(idx == s, alpha, 0.0), axis=0)
            acc += a * tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=ok)


def attn_res_fused(blocks: torch.Tensor | None, hidden: torch.Tensor | None, query: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """reference/attn_res.attn_res over sources = blocks [NB, N, D] (or None) followed by hidden [N, D] (or None):
    -> [N, D] in the sources' dtype (into `out` when given)."""
    srcs = [t for t in (blocks, hidden) if t is not None]
    if not srcs:
        raise ValueError("attn_res_fused: no sources")
    N, D = srcs[0].shape[-2:]
    if any(t.shape[-2:] != (N, D) or not t.is_contiguous() or t.dtype != srcs[0].dtype for t in srcs) \
            or query.shape != (D,) or norm_weight.shape != (D,):
        raise ValueError(f"attn_res_fused: contiguous sources [.., N, D] of one dtype and query, norm weight [D] "
                         f"expected, got {[tuple(t.shape) for t in srcs]}, {tuple(query.shape)}, "
                         f"{tuple(norm_weight.shape)}")
    if out is None:
        out = torch.empty(N, D, dtype=srcs[0].dtype, device=srcs[0].device)
    NB = 0 if blocks is None else blocks.shape[0]
    S = NB + (hidden is not None)
    if N:
        attn_res_kernel[(N,)](srcs[0], srcs[-1], query.contiguous(), norm_weight.contiguous(), out, N, float(eps),
                              D=D, NB=NB, PARTIAL=hidden is not None, S_BLOCK=max(2, triton.next_power_of_2(S)),
                              BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4)
    return out


def audit_specs(D: int = 7168, NB: int = 2, dtype: str = "bf16") -> list:
    sig = {"blocks_ptr": f"*{dtype}", "hidden_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
           "out_ptr": f"*{dtype}", "N": "i32", "eps": "fp32"}
    consts = {"D": D, "NB": NB, "PARTIAL": True, "S_BLOCK": triton.next_power_of_2(NB + 1), "BLOCK_D": 1024}
    return [kernel_spec(attn_res_kernel, sig, consts, static=("q_ptr", "w_ptr"), path=())]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    hidden = inputs["hidden"]
    blocks = inputs["blocks"] if "blocks" in op.inputs else None
    query, norm_w = (weights[n] for n in op.weights)
    if "blocks" in op.outputs:  # the block ends: its partial sum is frozen, the next one starts at zero
        nb = outputs["blocks"]
        old = 0 if blocks is None else blocks.shape[0]
        if old:
            nb[:old].copy_(blocks)
        nb[old].copy_(hidden)
        outputs["hidden"].zero_()
        blocks, hidden = nb, None  # the new block's partial sum is still empty: not a source
    attn_res_fused(blocks, hidden, query, norm_w, cfg.rms_norm_eps, out=outputs["layer_in"])


ATTN_RES_VARIANT = register(Variant(Manifest(
    name="triton-attn-res",
    description="Block AttnRes in one kernel a token: each source row's RMS and score against the query, the "
                "softmax over sources and the weighted sum, without the reference's concatenated sources; at a "
                "block's first layer the block is closed by two copies and a fill first",
    replaces=(ATTN_RES,),
    scope=Scope(families=("kimi_k3",), dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "cuda"),
                batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/attn_res.py", "megadecode/reference/attn_res.py"), uses_triton=True,
    graph_capturable=True, kernels=audit_specs),
    _run, kernel=attn_res_kernel))
