"""Projections over weights packed one after another in memory: one pass, one launch, for several weights that
read the same input (KDA's six input projections, an MLP's gate and up). The fused executor packs them at build
(`pack_rows`: memory-neutral, the same values, the entries become views of one tensor); a variant handed
separate tensors (the harness) gets their concatenation per call (`rows_view`), which is correct but copies.

`project` picks the projection's path by the number of tokens: backends/fused/kernels/linear.py's tensor-core projection up to
LINEAR_MAX_TOKENS (its programs take 16 tokens each, so it streams the weights once: ahead of cuBLAS at decode
batch sizes, bench/linear_paths.py on the H200: 37216 x 7168 at 95% of the HBM floor against cuBLAS'
86%), cuBLAS above (the Triton projection would read the weights once per 16 tokens).
"""

from __future__ import annotations

import torch

LINEAR_MAX_TOKENS = 16
# Shared memory a backends/fused/kernels/linear.py configuration may ask for (`fit_blocks`). The H200 allows 227 KB a
# block; the MLP's down projection of an fp32 model with the tuned blocks (BLOCK_K 256, 4 stages, fp32 weights) asks
# for 240 KB and fails to launch there (tests/test_expert_layout.py, tiny-k3-wide in fp32).
SMEM_BUDGET = 200 * 1024


def adjacent(ts: list[torch.Tensor]) -> bool:
    """Whether the 2-D tensors lie one after another in one storage, each contiguous, with one row length."""
    t0 = ts[0]
    if any(t.dim() != 2 or not t.is_contiguous() or t.shape[1] != t0.shape[1] or t.dtype != t0.dtype
           or t.device != t0.device for t in ts):
        return False
    same = all(t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() for t in ts)
    ends = [t.storage_offset() + t.numel() for t in ts[:-1]]
    return same and all(e == t.storage_offset() for e, t in zip(ends, ts[1:]))


def rows_view(ts: list[torch.Tensor]) -> torch.Tensor:
    """[sum of rows, K]: a view over adjacent tensors (`adjacent`), else their concatenation (a copy)."""
    if not adjacent(ts):
        return torch.cat(ts)
    t0 = ts[0]
    return t0.new_empty(0).set_(t0.untyped_storage(), t0.storage_offset(), (sum(t.shape[0] for t in ts), t0.shape[1]),
                               (t0.shape[1], 1))


def pack_rows(weights: dict[str, torch.Tensor], names: list[str], also: dict | None = None) -> None:
    """Put the named 2-D weights one after another in one new tensor and replace their entries by views of it
    (in `weights`, and in `also` where it holds the same tensors): the same values, one pass for rows_view. The
    old tensors are freed when nothing else holds them. Already adjacent, or not 2-D weights of one dtype, device
    and row length (rows_view could not view them as one): nothing to do."""
    ts = [weights[n] for n in names]
    t0 = ts[0]
    if adjacent(ts) or any(t.dim() != 2 or t.dtype != t0.dtype or t.device != t0.device or t.shape[1] != t0.shape[1]
                           for t in ts):
        return
    whole = torch.cat(ts)
    r = 0
    for n, t in zip(names, ts):
        v = whole[r:r + t.shape[0]]
        r += t.shape[0]
        if also is not None and also.get(n) is t:
            also[n] = v
        weights[n] = v


def fit_blocks(blocks: dict | None, w: torch.Tensor, x: torch.Tensor) -> dict | None:
    """`blocks` for backends/fused/kernels/linear.py when its pipelined tiles (num_stages x (BLOCK_N x BLOCK_K weights + BLOCK_K x
    BLOCK_M activations)) fit SMEM_BUDGET at these tensors' element sizes, else None: linear's defaults, which fit
    any dtype. The tuned blocks were measured on bf16 weights; fp32 weights take twice the room."""
    if not blocks:
        return blocks
    from .linear import DEFAULT_BLOCKS

    b = {**DEFAULT_BLOCKS, **blocks}
    need = b["num_stages"] * b["BLOCK_K"] * (b["BLOCK_N"] * w.element_size() + b["BLOCK_M"] * x.element_size())
    return blocks if need <= SMEM_BUDGET else None


def project(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None, blocks: dict | None = None):
    """x [T, K] @ w [N, K]^T -> [T, N] in x's dtype (into `out` when given), fp32 accumulation, rounded once
    as F.linear is: backends/fused/kernels/linear.py up to LINEAR_MAX_TOKENS tokens (`blocks` its block sizes), cuBLAS above."""
    if x.shape[0] <= LINEAR_MAX_TOKENS:
        from .linear import linear

        return linear(x, w, out_dtype=x.dtype, out=out, blocks=fit_blocks(blocks, w, x))
    if out is None:
        return torch.nn.functional.linear(x, w)
    return torch.mm(x, w.t(), out=out)
