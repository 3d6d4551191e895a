"""K3's Stable LatentMoE routed half in Triton (issue 5: "the K3 LatentMoE tail"): the plan's LATENT_MOE op

    h   = x @ latent_down^T                         [T, R]  fp32   (latent down, 7168 -> 3584)
    z   = sum_a w[t, a] * Expert_{ids[t, a]}(h[t])  [T, R]  fp32   (backends/fused/kernels/grouped_experts.routed_experts)
    out = (rmsnorm(z) * latent_norm) @ latent_up^T  [T, D]  x.dtype (the tail: norm fused into the up-projection)

What it replaces (the reference op, backends/torch_ops._latent_moe): F.linear on the weights cast to fp32
(`down_w.float()`, `up_w.float()`: each step writes and reads an fp32 copy of two 25.7M-weight matrices per
layer: by arithmetic, about 0.5 GB of extra traffic per K3 layer; not measured), and RMSNorm as a chain of elementwise ops.

The projections are backends/fused/kernels/linear.py's tensor-core `linear` (NORM: the RMSNorm fused into it).
"""

from __future__ import annotations

import torch

from ....contract import Manifest, Scope, Variant, register
from ....plan import LATENT_MOE
from ....quant.mxfp4 import MXFP4Tensor
from . import fused_experts, grouped_experts
from .grouped_experts import routed_experts
from .linear import audit_specs as linear_specs
from .linear import linear, linear_kernel


def latent_moe(x, ids, wts, down_w, gate_up: MXFP4Tensor, down: MXFP4Tensor, norm_w, up_w, *, act: str,
               eps: float, out: torch.Tensor | None = None, combine=None) -> torch.Tensor:
    """The LATENT_MOE op in Triton (see the module doc): three stages, no host sync. `combine` (expert
    parallelism: ids hold -1 for other ranks' experts): z, this rank's fp32 partial sum, becomes combine(z), the
    sum over the ranks, before the norm."""
    h = linear(x.contiguous(), down_w)
    z = routed_experts(h, ids.contiguous(), wts.float().contiguous(), gate_up, down, act=act)
    if combine is not None:
        z = combine(z)
    return linear(z, up_w, norm_weight=norm_w, eps=eps, out_dtype=x.dtype, out=out)


def audit_specs(dtype: str = "bf16", D: int = 7168, R: int = 3584, I: int = 3072, A: int = 16) -> list:
    """Every kernel the op can launch at K3's dims: the latent down (plain) and up (RMSNorm fused) projections,
    and the routed MXFP4 experts on each path routed_experts picks: the FMA kernels (<= 16 tokens, scales that
    rule out the fast decode, and the CPU), the tensor-core kernels per pair and grouped, exact and fast."""
    return [*linear_specs(dtype, norm=False, K=D, N=R, x_dtype=dtype, partials=False, out_dtype="fp32"),
            *linear_specs(dtype, norm=True, K=R, N=D, x_dtype="fp32"),
            *fused_experts.audit_specs("fp32", True, "situ", D=R, I=I, A=A),
            *grouped_experts.all_paths("fp32", True, "situ", D=R, I=I, A=A)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    down_w, gu_p, gu_s, dn_p, dn_s, norm_w, up_w = (weights[n] for n in op.weights)
    latent_moe(x, ids, wts, down_w, MXFP4Tensor(gu_p, gu_s), MXFP4Tensor(dn_p, dn_s), norm_w, up_w,
               act=cfg.expert_act, eps=cfg.rms_norm_eps, out=outputs[op.outputs[0]])


LATENT_MOE_VARIANT = register(Variant(Manifest(
    name="triton-latent-moe",
    description="K3 LatentMoE routed half: latent down and (RMSNorm fused into) latent up as tensor-core "
                "projections on the weights' own dtype (no fp32 weight copies), routed MXFP4 experts through "
                "backends/fused/kernels/grouped_experts.routed_experts; fp32 accumulation",
    replaces=(LATENT_MOE,),
    scope=Scope(families=("kimi_k3",), dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "cuda"),
                batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/latent_moe.py", "megadecode/backends/fused/kernels/linear.py", "megadecode/backends/fused/kernels/common.py",
             "megadecode/backends/fused/kernels/grouped_experts.py", "megadecode/backends/fused/kernels/fused_experts.py"), uses_triton=True,
    graph_capturable=True, kernels=audit_specs),
    _run, kernel=linear_kernel))
