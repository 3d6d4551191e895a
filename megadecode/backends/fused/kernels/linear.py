"""The tensor-core projection on the weights' own dtype: out = x @ W^T, optionally RMSNorm(x) first, or as
K-chunk partial sums (used by K3's LatentMoE op for latent down / up, and by the router for its logits).

`linear_kernel` (both projections): program (n-tile of BLOCK_N weight rows, chunk of BLOCK_M tokens) streams
its rows of W over K through tensor cores (weights on the MMA's M side, tokens on its N side, as in
backends/fused/kernels/grouped_experts.py), fp32 accumulation. Weights in their own dtype (bf16/fp16: fp32 activations are
split into hi + lo parts of that dtype, two MMAs; fp32 weights: IEEE fp32 dots). NORM: the token's
sum of squares is accumulated in the same K loop from the activations it already loads, the activations are
multiplied by the norm weight on the way in, and the dot products by rsqrt(mean + eps) at the end:
    out[t, n] = rsqrt(mean_k z[t, k]^2 + eps) * sum_k W[n, k] * (z[t, k] * g[k])
which is rmsnorm(z) * g followed by the projection, for fp32 z (the reference's rounding of the normalized
row to the input dtype is a no-op in fp32). Memory paths: W and g static; x produced (plain loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import kernel_spec
from .common import mma

DEFAULT_BLOCKS = {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


@triton.jit
def linear_kernel(x_ptr, w_ptr, g_ptr, out_ptr, T, stride_x, stride_w, stride_out, eps, N: tl.constexpr,
                  K: tl.constexpr, NORM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, KC: tl.constexpr = 0):
    """Program (n-tile, token chunk[, K chunk]): out[t, n] = [rsqrt(mean z^2 + eps)] * sum_k W[n, k] (x[t, k]
    [* g[k]]). KC > 0 (no NORM): program axis 2 takes the K chunk [kc * KC, (kc + 1) * KC) and writes its
    partial sums to out[kc] (out is [K / KC, T, N] fp32)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_lo = 0
    k_hi = K
    if KC > 0:
        k_lo = tl.program_id(2) * KC
        k_hi = tl.minimum(k_lo + KC, K)
        out_ptr += tl.program_id(2).to(tl.int64) * T * N
    for k0 in range(0, KC if KC > 0 else K, BLOCK_K):
        k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
        v = tl.load(x_ptr + m[None, :].to(tl.int64) * stride_x + k[:, None], mask=k_ok[:, None] & m_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_M]
        if NORM:
            ss += tl.sum(v * v, axis=0)
            v = v * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        acc = mma(w, v, acc, SPLIT)
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[None, :]
    tl.store(out_ptr + m[None, :].to(tl.int64) * stride_out + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


def linear(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
           blocks: dict | None = None) -> torch.Tensor:
    """x [T, K] float @ w [N, K]^T (bf16/fp16/fp32, unit stride over K) -> [T, N] out_dtype, fp32 accumulation.
    norm_weight [K]: apply RMSNorm (fp32 statistics) with that weight to each row of x first. `out`: written
    in place when given ([T, N], unit stride over N; its dtype wins over out_dtype)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x [T, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("linear: x and w need unit stride over K")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not x.is_floating_point():
        raise ValueError(f"linear: float tensors expected, got x {x.dtype}, w {w.dtype}")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous()):
        raise ValueError(f"linear: norm_weight must be contiguous [{x.shape[1]}]")
    if x.device != w.device:
        raise ValueError(f"linear: x on {x.device}, w on {w.device}")
    T, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(T, N, dtype=out_dtype, device=x.device)
    elif out.shape != (T, N) or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"linear: out must be [{T}, {N}] with unit stride over N on {x.device}, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if T == 0:
        return out
    b = {**DEFAULT_BLOCKS, **(blocks or {})}
    bn = max(16, min(b["BLOCK_N"], triton.next_power_of_2(N)))
    bk = max(16, min(b["BLOCK_K"], triton.next_power_of_2(K)))
    g = norm_weight if norm_weight is not None else w
    split = x.dtype == torch.float32 and w.dtype != torch.float32
    linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, b["BLOCK_M"]))](
        x, w, g, out, T, x.stride(0), w.stride(0), out.stride(0), float(eps), N=N, K=K,
        NORM=norm_weight is not None, SPLIT=split, BLOCK_N=bn, BLOCK_M=b["BLOCK_M"], BLOCK_K=bk,
        num_warps=b["num_warps"], num_stages=b["num_stages"])
    return out


def linear_partials(x: torch.Tensor, w: torch.Tensor, k_splits: int) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T cut over K into k_splits chunks: -> [k_splits', T, N] fp32 partial sums (k_splits'
    <= k_splits: whole BLOCK_K tiles per chunk), for a consumer that adds them in a fixed order (the router's
    selection kernel). For a small N at batch 1, the plain linear has too few programs to stream w quickly."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"linear_partials: x [T, K] and w [N, K] with unit stride over K expected, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not x.is_floating_point():
        raise ValueError(f"linear_partials: float tensors expected, got x {x.dtype}, w {w.dtype}")
    T, K = x.shape
    N = w.shape[0]
    bn, bk, bm = max(16, min(64, triton.next_power_of_2(N))), max(16, min(128, triton.next_power_of_2(K))), 16
    kc = triton.cdiv(triton.cdiv(K, max(1, k_splits)), bk) * bk
    ks = triton.cdiv(K, kc)
    out = torch.empty(ks, T, N, dtype=torch.float32, device=x.device)
    if T:
        linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bm), ks)](
            x, w, w, out, T, x.stride(0), w.stride(0), N, 0.0, N=N, K=K, NORM=False,
            SPLIT=x.dtype == torch.float32 and w.dtype != torch.float32, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, KC=kc,
            num_warps=4, num_stages=3)
    return out


def audit_specs(dtype: str = "bf16", norm: bool = True, K: int = 3584, N: int = 7168, x_dtype: str = "fp32",
                partials: bool | None = None, out_dtype: str | None = None) -> list:
    """linear_kernel at weights of `dtype`, activations of `x_dtype`: the normed projection (NORM), the plain one,
    or the K-chunk partials (KC > 0: the router's logits; default: when not normed). Path constexprs: NORM and KC
    (0 or more); SPLIT (hi + lo parts for fp32 activations on 16-bit weights) is the dtypes' choice."""
    partials = (not norm) if partials is None else partials
    sig = {"x_ptr": f"*{x_dtype}", "w_ptr": f"*{dtype}", "g_ptr": f"*{dtype}",
           "out_ptr": "*fp32" if partials else f"*{out_dtype or dtype}", "T": "i32", "stride_x": "i32",
           "stride_w": "i32", "stride_out": "i32", "eps": "fp32"}
    consts = {"N": N, "K": K, "NORM": norm, "SPLIT": dtype != "fp32" and x_dtype == "fp32",
              "BLOCK_N": DEFAULT_BLOCKS["BLOCK_N"], "BLOCK_M": DEFAULT_BLOCKS["BLOCK_M"],
              "BLOCK_K": DEFAULT_BLOCKS["BLOCK_K"], "KC": 512 if partials else 0}
    return [kernel_spec(linear_kernel, sig, consts, static=("w_ptr", "g_ptr"), path=("NORM", "KC"))]
