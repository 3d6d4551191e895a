"""A copy of the RMSNorm kernel (backends/fused/kernels/rmsnorm.py) with planted mistakes, one constexpr each, for the
`broken-rmsnorm-*` variants of broken.py: realistic slips that the base cases of the harness (power-of-two
hidden sizes, well-scaled rows, a name-keyed audit) used to let through.

  MASK_OVERRUN  the store mask `d <= D` instead of `d < D`: one element past each row, only when the row is a
                partial tile (D not a power of two); the last row's lands past the output (guard regions)
  POW2_MEAN     the mean of squares divided by BLOCK_D instead of D: wrong only when D is not a power of two
  SUMSQ_16BIT   the sum of squares accumulated in the input dtype: fp16 overflows on large rows (|x| ~ 4096)
  EPS_OUTSIDE   x / (sqrt(mean) + eps) instead of x / sqrt(mean + eps): visible only on rows of tiny norm
  EPS_SIGN      rsqrt(mean - eps): NaN on rows whose mean square is below eps (a value computed, not left)
  NC_LOAD       x (produced during the step) read through the non-coherent path (ld.global.nc, inline PTX: on
                the GPU only; the interpreter reads it plainly): right numbers, caught by the static audit alone
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import kernel_spec
from .handoff import _ld_nc_f32

FLAGS = ("MASK_OVERRUN", "POW2_MEAN", "SUMSQ_16BIT", "EPS_OUTSIDE", "EPS_SIGN", "NC_LOAD")


@triton.jit
def rmsnorm_mutant_kernel(x_ptr, w_ptr, out_ptr, T, stride_x, stride_out, eps, D: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, MASK_OVERRUN: tl.constexpr,
                          POW2_MEAN: tl.constexpr, SUMSQ_16BIT: tl.constexpr, EPS_OUTSIDE: tl.constexpr,
                          EPS_SIGN: tl.constexpr, NC_LOAD: tl.constexpr, USE_ASM: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = (t < T)[:, None] & (d < D)[None, :]
    if NC_LOAD and USE_ASM:
        x = _ld_nc_f32(x_ptr + t[:, None] * stride_x + d[None, :], ok)
    else:
        x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    if SUMSQ_16BIT:
        xh = x.to(x_ptr.dtype.element_ty)
        ss = tl.sum(xh * xh, axis=1).to(tl.float32)
    else:
        ss = tl.sum(x * x, axis=1)
    if POW2_MEAN:
        mean = ss / BLOCK_D
    else:
        mean = ss / D
    if EPS_OUTSIDE:
        inv = 1.0 / (tl.sqrt(mean) + eps)
    elif EPS_SIGN:
        inv = 1.0 / tl.sqrt(mean - eps)
    else:
        inv = 1.0 / tl.sqrt(mean + eps)
    y = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if MASK_OVERRUN:
        store_ok = (t < T)[:, None] & (d <= D)[None, :]
    else:
        store_ok = ok
    tl.store(out_ptr + t[:, None] * stride_out + d[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty),
             mask=store_ok)


def rms_norm_mutant(x, weight, eps: float, out, **planted) -> None:
    """backends/fused/kernels/rmsnorm.rms_norm_triton with the planted flags (FLAGS, default False)."""
    from ..backends.fused.kernels.rmsnorm import check_args

    unknown = set(planted) - set(FLAGS)
    if unknown:
        raise TypeError(f"unknown planted flags {sorted(unknown)}; flags: {FLAGS}")
    check_args(x, weight, out)
    if planted.get("NC_LOAD") and x.is_cuda and x.dtype != torch.float32:
        # its load is one 32-bit word per element: on 16-bit rows every odd element's address is misaligned (a
        # CUDA error that poisons the process), so the variant's scope is fp32 (broken.py)
        raise ValueError(f"the NC_LOAD mutant reads fp32 rows only, got {x.dtype}")
    n = x.shape[0]
    if n:
        block_d = triton.next_power_of_2(x.shape[1])
        block_t = min(triton.next_power_of_2(n), max(1, 4096 // block_d))
        rmsnorm_mutant_kernel[(triton.cdiv(n, block_t),)](
            x, weight, out, n, x.stride(0), out.stride(0), float(eps), D=x.shape[1], BLOCK_T=block_t, BLOCK_D=block_d,
            **{f: bool(planted.get(f, False)) for f in FLAGS}, USE_ASM=x.is_cuda)


def mutant_specs(**planted) -> list:
    """The mutant kernel at bf16 and K3's hidden size with these flags (fp32 x for NC_LOAD: its load is 32-bit)."""
    D = 7168
    block_d = triton.next_power_of_2(D)
    dt = "fp32" if planted.get("NC_LOAD") else "bf16"
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "T": "i32", "stride_x": "i32",
           "stride_out": "i32", "eps": "fp32"}
    consts = {"D": D, "BLOCK_T": 1, "BLOCK_D": block_d, **{f: bool(planted.get(f, False)) for f in FLAGS},
              "USE_ASM": True}
    return [kernel_spec(rmsnorm_mutant_kernel, sig, consts, static=("w_ptr",), free=("USE_ASM",))]
