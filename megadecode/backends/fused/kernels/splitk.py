"""Split over the cache length for the decode attention kernels (flash-decoding), shared by backends/fused/kernels/gqa.py and
backends/fused/kernels/mla.py.

At batch 1 a decode attention has few (sequence, head group) programs: 4 for Qwen3-30B-A3B's kv heads, 6 for
K3's 96 MLA heads in blocks of 16. Each then streams its whole cache alone and the H200's 132 SMs sit idle.
So the cache is cut into S chunks of CHUNK positions; program (row group, chunk) runs the online softmax over
its chunk and writes a partial (running max m, running sum l, unnormalised output acc, all fp32), and
`combine` merges the S partials of each output row:
    M = max_s m_s,   o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
A chunk past the sequence's position writes m = -inf, l = 0, acc = 0 and drops out (exp(-inf) = 0); chunk 0
always holds position 0, so M is finite. The merge order is fixed: results do not depend on timing.
The partials are produced by an earlier launch: plain loads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ....contract import kernel_spec


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)
    return 2  # the interpreter: small, but still more than one chunk so that CI runs the merge


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:  # asked once per GPU, not on every launch
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(programs: int, kv_len: int, block_l: int, device: torch.device,
               splits: int | None = None) -> tuple[int, int]:
    """(S, CHUNK): how many chunks of how many positions (a multiple of block_l) cover kv_len positions, so
    that programs * S fills the GPU about twice. `splits` forces S (tests)."""
    max_s = triton.cdiv(max(kv_len, 1), block_l)
    s = splits if splits is not None else triton.cdiv(2 * num_sms(device), max(programs, 1))
    s = max(1, min(s, max_s))
    chunk = triton.cdiv(triton.cdiv(max(kv_len, 1), s), block_l) * block_l
    return triton.cdiv(max(kv_len, 1), chunk), chunk


@triton.jit
def store_partials(m_ptr, l_ptr, acc_ptr, rows, row_ok, sp, S, m_i, l_i, acc, cols, col_ok, W):
    """A split program's partials of chunk sp for output rows `rows` (m, l [R, S]; acc [R, S, W])."""
    prow = rows * S + sp
    tl.store(m_ptr + prow, m_i, mask=row_ok)
    tl.store(l_ptr + prow, l_i, mask=row_ok)
    tl.store(acc_ptr + prow[:, None] * W + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, W, S, BLOCK_S: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """Program (row r, column block): o[r, cols] from the S partials m/l [R, S], acc [R, S, W]."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c_ok = cols < W
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    m = tl.load(m_ptr + r * S + s, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + r * S + s, mask=s_ok, other=0.0)
    big = tl.max(m, axis=0)
    wgt = tl.where(s_ok, tl.exp(m - big), 0.0)
    acc = tl.load(acc_ptr + (r * S + s[:, None]) * W + cols[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    o = tl.sum(acc * wgt[:, None], axis=0) / tl.sum(l * wgt, axis=0)
    tl.store(o_ptr + r * W + cols, o.to(o_ptr.dtype.element_ty), mask=c_ok)


def partials(rows: int, s: int, width: int, device: torch.device):
    """Empty m, l [rows, s] and acc [rows, s, width] (fp32): every element is written by the split kernel."""
    return (torch.empty(rows, s, dtype=torch.float32, device=device),
            torch.empty(rows, s, dtype=torch.float32, device=device),
            torch.empty(rows, s, width, dtype=torch.float32, device=device))


def combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [rows, width] (any float dtype, contiguous) <- the merge of the partials."""
    rows, s, width = acc.shape
    if out.numel() != rows * width or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with {rows} x {width} elements, got {tuple(out.shape)}")
    if rows:
        block_w = min(128, max(16, triton.next_power_of_2(width)))
        combine_kernel[(rows, triton.cdiv(width, block_w))](m, l, acc, out, width, S=s,
                                                             BLOCK_S=max(2, triton.next_power_of_2(s)),
                                                             BLOCK_W=block_w)
    return out


def audit_specs(dtype: str = "bf16") -> list:
    sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "o_ptr": f"*{dtype}", "W": "i32", "S": "i32"}
    return [kernel_spec(combine_kernel, sig, {"BLOCK_S": 64, "BLOCK_W": 128})]
