"""Kimi K3 Stable LatentMoE layer: the reference (plain PyTorch, fp32 throughout).

Legend: T tokens, E routed experts (896), A active per token (16), D hidden (7168),
R latent (3584), I routed-expert intermediate (3072), S shared intermediate (6144 = 2 x 3072).

    ids, w  = route(x)                                   router on the full-width x [T, D]
    h       = x @ latent_down^T                          [T, R]
    gu_ta   = gate_up[ids[t, a]] @ h[t]                  [T, A, 2I]  (g = first I, u = last I)
    y_ta    = down[ids[t, a]] @ situ_glu(g, u)           [T, A, R]
    z       = rms_norm(sum_a w[t, a] * y_ta, latent_norm) [T, R]    norm on the weighted SUM
    out     = z @ latent_up^T + shared(x)                [T, D]

Routing (`megadecode.reference.routing.route`, sigmoid branch): s = sigmoid(x W^T) in fp32; the
selection bias (`router.bias`) is added for choosing only; optional groups (`n_group`,
`topk_group`); top-A with ties to the lower expert index; weights = s of the picks, renormalised
when `norm_topk_prob`, times `routed_scaling_factor` (1.0 for K3).
SiTU-GLU: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25) (soft-capped SiLU gate times soft-capped up).
Shared experts: the SPEC gives two full-width shared experts with combined intermediate 6144 on
the layer input, added to the output. Two GLU experts summed equal one GLU expert with their
intermediates concatenated, so they are stored as one `shared_experts` module with S = 6144.
Their activation is not stated in the SPEC: we use SiLU-GLU (SwiGLU, as DeepSeek-V3's shared
expert); `LatentMoEParams.shared_act = "situ"` switches to SiTU-GLU if the checkpoint says so.
Routed experts may be dense tensors [E, ...] or `MXFP4Tensor`s (packed along the input dim);
quantized experts are decoded exactly, one selected expert at a time.
Precision: every product and sum in fp32 (weights and x upcast); the result is cast to x.dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant.mxfp4 import MXFP4Tensor
from .activations import GLUS
from .norm import rms_norm
from .routing import route


@dataclass(frozen=True)
class LatentMoEParams:
    """The layer's hyper-parameters; also the config-like object `route` reads (sigmoid scoring)."""
    num_experts: int = 896
    top_k: int = 16
    hidden: int = 7168
    latent: int = 3584
    intermediate: int = 3072
    shared_intermediate: int = 6144
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    shared_act: str = "silu"  # "silu" | "situ"
    score_func: str = "sigmoid"  # route() reads it; LatentMoE routing is sigmoid only

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"LatentMoEParams: {msg}")
        need(self.score_func == "sigmoid", "Stable LatentMoE routes with sigmoid scores")
        need(1 <= self.top_k <= self.num_experts, f"top_k ({self.top_k}) must be in [1, num_experts]")
        need(self.n_group >= 1 and self.num_experts % self.n_group == 0,
             f"num_experts ({self.num_experts}) must divide into n_group ({self.n_group}) groups")
        need(1 <= self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be in [1, n_group]")
        if self.n_group > 1:
            need(self.num_experts // self.n_group >= 2, "groups score their 2 best experts: need >= 2 per group")
            need(self.top_k <= self.topk_group * self.num_experts // self.n_group,
                 "top_k exceeds the experts left in the kept groups")
        need(self.shared_act in ("silu", "situ"), f"unknown shared activation {self.shared_act!r}")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The layer's tensors in the model's names ([out, in] for projections)."""
        E, D, R, I, S = self.num_experts, self.hidden, self.latent, self.intermediate, self.shared_intermediate
        return {
            "router.weight": (E, D), "router.bias": (E,),
            "latent_down.weight": (R, D), "latent_up.weight": (D, R), "latent_norm.weight": (R,),
            "experts.gate_up_proj": (E, 2 * I, R), "experts.down_proj": (E, R, I),
            "shared_experts.gate_proj.weight": (S, D), "shared_experts.up_proj.weight": (S, D),
            "shared_experts.down_proj.weight": (D, S),
        }


def check_weights(weights: dict, p: LatentMoEParams) -> None:
    """Raise ValueError naming the first missing or mis-shaped tensor."""
    for name, shape in p.weight_shapes().items():
        if name not in weights:
            raise ValueError(f"LatentMoE weights: missing {name!r}")
        got = tuple(weights[name].shape)
        if got != shape:
            raise ValueError(f"LatentMoE weights: {name!r} has shape {got}, expected {shape}")


def _expert(w, e: int) -> torch.Tensor:
    """One routed expert's weight in fp32, decoding MXFP4 exactly (only the selected expert)."""
    return w[e].dequantize(torch.float32) if isinstance(w, MXFP4Tensor) else w[e].float()


def latent_experts(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up, down,
                   act: str = "situ") -> torch.Tensor:
    """sum_a w[t, a] * Expert_{ids[t, a]}(h[t]) in fp32; h [T, R], gate_up [E, 2I, R], down [E, R, I].
    `act`: the GLU activation, "situ" (SiTU-GLU, K3) or "silu" (SwiGLU). Pairs with id -1 are skipped (expert
    parallelism: another rank's expert).

    Loops over the experts that received tokens (a host sync; not graph-capturable)."""
    z = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = F.linear(h[tok], _expert(gate_up, e)).chunk(2, dim=-1)
        a = GLUS[act](g, u)
        y = F.linear(a, _expert(down, e))  # [T_e, R]
        z.index_add_(0, tok, y * w[tok, slot, None].float())
    return z


def shared_experts(x: torch.Tensor, weights: dict, act: str = "silu") -> torch.Tensor:
    """The two full-width shared experts as one GLU with S = 6144 (see the module doc); fp32."""
    xf = x.float()
    g = F.linear(xf, weights["shared_experts.gate_proj.weight"].float())
    u = F.linear(xf, weights["shared_experts.up_proj.weight"].float())
    a = GLUS[act](g, u)
    return F.linear(a, weights["shared_experts.down_proj.weight"].float())


def latent_moe_route(x: torch.Tensor, weights: dict, p: LatentMoEParams):
    """x [T, D] -> (ids [T, A] int64, weights [T, A] fp32): the DeepSeek `noaux_tc` rules on full-width x."""
    return route(p, x, weights["router.weight"], weights["router.bias"])


def latent_moe_reference(x: torch.Tensor, weights: dict, p: LatentMoEParams) -> torch.Tensor:
    """The Stable LatentMoE layer: x [T, D] -> [T, D] (the MLP output, before the residual add)."""
    check_weights(weights, p)
    xf = x.float()
    ids, w = latent_moe_route(x, weights, p)
    h = F.linear(xf, weights["latent_down.weight"].float())  # [T, R]
    z = latent_experts(h, ids, w, weights["experts.gate_up_proj"], weights["experts.down_proj"])
    z = rms_norm(z, weights["latent_norm.weight"].float(), p.rms_norm_eps)  # on the weighted sum
    out = F.linear(z, weights["latent_up.weight"].float()) + shared_experts(x, weights, p.shared_act)
    return out.to(x.dtype)
