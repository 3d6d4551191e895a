"""The SwiGLU MLP (dense layers, shared experts) in three launches: gate and up as one projection, the SiLU
product as one elementwise kernel, down.

reference/norm.py swiglu_mlp is F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down): three cuBLAS
GEMVs and two elementwise kernels. On the H200 at batch 1 (bench/profile_step.py, k3-mini's shared
experts, 264 MB a layer): 98 us of kernels for a 58 us floor, 76-81% of the floor in each GEMV. Here:
    gu  = x [gate; up]^T            backends/fused/kernels/packed.project (one pass over both when packed one after the other:
                                    the fused executor packs them at build), rounded to the model dtype
    h   = round(silu(g)) * u        rounded to the model dtype, as the reference's two bf16 ops
    out = h down^T                  backends/fused/kernels/packed.project
Memory paths: gu comes from the launch before (plain loads); no weights in the elementwise kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import MLP
from .packed import project, rows_view

# backends/fused/kernels/linear.py blocks (bench/linear_paths.py on the H200: 12288 x 7168 at 87% of the floor with
# the defaults, 7168 x 6144 at 82% with these)
UP_BLOCKS: dict = {}
DOWN_BLOCKS = {"BLOCK_K": 256, "num_stages": 4}


@triton.jit
def swiglu_kernel(gu_ptr, h_ptr, stride_gu, stride_h, I: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, column tile): h[t, c] = round(silu(gu[t, c])) * gu[t, I + c], rounded to h's dtype."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(gu_ptr + t * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + c, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(h_ptr + t * stride_h + c, (s * u).to(h_ptr.dtype.element_ty), mask=ok)


def swiglu_mlp_fused(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """reference/norm.py swiglu_mlp: x [T, D], gate/up [I, D], down [D, I] -> [T, D] (into `out` when given)."""
    T, D = x.shape
    I = gate.shape[0]
    if up.shape != (I, D) or gate.shape != (I, D) or down.shape != (D, I):
        raise ValueError(f"swiglu_mlp_fused: gate, up [I, {D}] and down [{D}, I] expected, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}, {tuple(down.shape)}")
    if out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    gu = project(x.contiguous(), rows_view([gate, up]), blocks=UP_BLOCKS)
    h = torch.empty(T, I, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(I))
    swiglu_kernel[(T, triton.cdiv(I, block))](gu, h, gu.stride(0), h.stride(0), I=I, BLOCK=block, num_warps=4)
    return project(h, down, out=out, blocks=DOWN_BLOCKS)


def audit_specs(I: int = 6144, D: int = 7168, dtype: str = "bf16") -> list:
    from .linear import audit_specs as linear_specs

    sig = {"gu_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "stride_gu": "i32", "stride_h": "i32"}
    return [kernel_spec(swiglu_kernel, sig, {"I": I, "BLOCK": 1024}),
            *linear_specs(dtype, norm=False, K=D, N=2 * I, x_dtype=dtype, partials=False),
            *linear_specs(dtype, norm=False, K=I, N=D, x_dtype=dtype, partials=False)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    gate, up, down = (weights[n] for n in op.weights)
    swiglu_mlp_fused(inputs[op.inputs[0]], gate, up, down, out=outputs[op.outputs[0]])


MLP_VARIANT = register(Variant(Manifest(
    name="triton-mlp",
    description="SwiGLU MLP in three launches: gate and up as one tensor-core projection (packed one after the "
                "other by the fused executor), the SiLU product, down; cuBLAS for the projections above 16 tokens",
    replaces=(MLP,),
    # not qwen3_moe: its models have no dense layers (the harness's qwen3_moe preset has no MLP op to check)
    scope=Scope(families=("deepseek_v3", "kimi_linear", "kimi_k3"), batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/mlp.py", "megadecode/backends/fused/kernels/packed.py", "megadecode/backends/fused/kernels/linear.py",
             "megadecode/backends/fused/kernels/common.py", "megadecode/reference/norm.py"), uses_triton=True,
    graph_capturable=True, kernels=audit_specs),
    _run, kernel=swiglu_kernel))
