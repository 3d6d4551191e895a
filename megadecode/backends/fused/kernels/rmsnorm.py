"""RMSNorm as a Triton kernel, a block of rows per program: y = w * (x / sqrt(mean(x^2) + eps)), statistics in
fp32, the normalised row rounded to the input dtype before the weight (as reference/norm.py).

`add_rmsnorm_kernel` (variant triton-add-rmsnorm) is the residual add fused with the norm that follows it
(the plan's ADD_RMSNORM composite, plan.fuse_add_rmsnorm): s = a + b rounded to the model dtype (as the
reference add), written out (the residual stream), and y = rmsnorm(s) from the same registers: the sum is read
once instead of written by one kernel and read back by the next."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....config import ModelConfig
from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....config.registry import FAMILIES  # every family
from ....plan import ADD_RMSNORM, RMSNORM


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, T, stride_x, stride_out, eps, D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_T rows per program, each row's statistics its own (batch invariant)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = (t < T)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_out + d[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def add_rmsnorm_kernel(a_ptr, b_ptr, w_ptr, sum_ptr, out_ptr, T, stride_a, stride_b, stride_s, stride_out, eps,
                       D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_T rows per program: sum = a + b (rounded to sum's dtype), out = rmsnorm(sum) * w."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = (t < T)[:, None] & (d < D)[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_a + d[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_b + d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = (a + b).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + t[:, None] * stride_s + d[None, :], s, mask=ok)
    x = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * inv[:, None]).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_out + d[None, :], (w[None, :] * y).to(out_ptr.dtype.element_ty),
             mask=ok)


def add_rms_norm_triton(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, sum_out: torch.Tensor,
                        out: torch.Tensor) -> None:
    """Writes a + b into sum_out and rms_norm(a + b) into out (all [T, D], one dtype, unit stride over D)."""
    if not (a.shape == b.shape == sum_out.shape == out.shape) or a.dim() != 2:
        raise ValueError(f"add_rmsnorm: a, b, sum_out and out must be one [T, D] shape, got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(sum_out.shape)}, {tuple(out.shape)}")
    if any(t.stride(1) != 1 for t in (a, b, sum_out, out)):
        raise ValueError("add_rmsnorm: unit stride over D expected")
    if not (a.dtype == b.dtype == sum_out.dtype == out.dtype == weight.dtype):
        raise ValueError(f"add_rmsnorm: one dtype expected, got {a.dtype}, {b.dtype}, {sum_out.dtype}, {out.dtype}, "
                         f"weight {weight.dtype}")
    if weight.shape != (a.shape[1],) or not weight.is_contiguous() or a.shape[1] > 16384:
        raise ValueError(f"add_rmsnorm: weight must be contiguous [{a.shape[1]}] and D <= 16384")
    n = a.shape[0]
    if n > 0:
        block_d = triton.next_power_of_2(a.shape[1])
        block_t = min(triton.next_power_of_2(n), max(1, 4096 // block_d))
        add_rmsnorm_kernel[(triton.cdiv(n, block_t),)](
            a, b, weight, sum_out, out, n, a.stride(0), b.stride(0), sum_out.stride(0), out.stride(0), float(eps),
            D=a.shape[1], BLOCK_T=block_t, BLOCK_D=block_d)


def check_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, D] with unit stride over D, got {x.stride()}"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), f"weight must be [{x.shape[1]}] contiguous"
    assert out.shape == x.shape and out.stride(1) == 1, f"out {tuple(out.shape)} must match x {tuple(x.shape)}"
    assert x.dtype == weight.dtype == out.dtype, f"dtypes differ: x {x.dtype}, w {weight.dtype}, out {out.dtype}"
    assert x.device == weight.device == out.device, "all tensors on one device"
    assert x.shape[1] <= 16384, "one program holds a whole row: D <= 16384"


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, rows: int | None = None):
    """Writes rms_norm(x) into out. `rows` normalises only the first rows (only the broken variants use it)."""
    check_args(x, weight, out)
    n = x.shape[0] if rows is None else rows
    if n > 0:
        block_d = triton.next_power_of_2(x.shape[1])
        block_t = min(triton.next_power_of_2(n), max(1, 4096 // block_d))  # a tile of <= 4096 values
        rmsnorm_kernel[(triton.cdiv(n, block_t),)](x, weight, out, n, x.stride(0), out.stride(0), float(eps),
                                                   D=x.shape[1], BLOCK_T=block_t, BLOCK_D=block_d)


def audit_specs(dtype: str = "bf16", D: int = 7168) -> list:
    """Both kernels at bf16 and K3's hidden size (one specialization each: no code-path constexprs)."""
    block_d = triton.next_power_of_2(D)
    consts = {"D": D, "BLOCK_T": max(1, 4096 // block_d), "BLOCK_D": block_d}
    norm = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "T": "i32", "stride_x": "i32",
            "stride_out": "i32", "eps": "fp32"}
    add = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}",
           "out_ptr": f"*{dtype}", "T": "i32", "stride_a": "i32", "stride_b": "i32", "stride_s": "i32",
           "stride_out": "i32", "eps": "fp32"}
    return [kernel_spec(rmsnorm_kernel, norm, consts, static=("w_ptr",)),
            kernel_spec(add_rmsnorm_kernel, add, consts, static=("w_ptr",))]


def gather_rows(op, inputs) -> torch.Tensor:
    """The final norm reads only the rows whose logits are wanted (op.inputs[1])."""
    x = inputs[op.inputs[0]]
    return x[inputs[op.inputs[1]]] if len(op.inputs) == 2 else x


def _run(op, inputs, weights, outputs, cfg: ModelConfig, step, cache=None):
    rms_norm_triton(gather_rows(op, inputs), weights[op.weights[0]], cfg.rms_norm_eps, outputs[op.outputs[0]])


LIMITS = (("hidden_size", 1, 16384),)  # one program holds a whole row


RMSNORM_VARIANT = register(Variant(Manifest(
    name="triton-rmsnorm", description="RMSNorm, a block of rows per Triton program, fp32 statistics",
    replaces=(RMSNORM,), scope=Scope(families=FAMILIES, limits=LIMITS), sources=("megadecode/backends/fused/kernels/rmsnorm.py",),
    uses_triton=True, kernels=lambda: audit_specs()[:1]),
    _run, kernel=rmsnorm_kernel))


def _run_add(op, inputs, weights, outputs, cfg: ModelConfig, step, cache=None):
    a, b = (inputs[n] for n in op.inputs)
    add_rms_norm_triton(a, b, weights[op.weights[0]], cfg.rms_norm_eps, outputs[op.outputs[0]],
                        outputs[op.outputs[1]])


ADD_RMSNORM_VARIANT = register(Variant(Manifest(
    name="triton-add-rmsnorm",
    description="the residual add fused with the RMSNorm after it (plan.fuse_add_rmsnorm's ADD_RMSNORM): "
                "writes the sum and the normed sum from one read of the addends, fp32 statistics",
    replaces=(ADD_RMSNORM,), scope=Scope(families=FAMILIES, limits=LIMITS), sources=("megadecode/backends/fused/kernels/rmsnorm.py",),
    uses_triton=True, graph_capturable=True, kernels=lambda: audit_specs()[1:]),
    _run_add, kernel=add_rmsnorm_kernel))
