"""The gated activations of the experts (GLU: a gate g and an up projection u of the same width)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(g) * u (Qwen3-MoE, DeepSeek-V3, the shared and dense MLPs)."""
    return F.silu(g) * u


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU (Kimi K3's routed experts): 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), a soft-capped SiLU gate
    times a soft-capped up projection."""
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * (25 * torch.tanh(u / 25))


GLUS = {"silu": silu_glu, "situ": situ_glu}  # the names config.json uses (`moe_hidden_act`)
