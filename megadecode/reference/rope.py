"""Rotary position embeddings: default and YaRN frequencies, half-split and interleaved pairings."""

from __future__ import annotations

import functools
import math

import torch

from ..config import ModelConfig, RopeConfig, yarn_mscale


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] (fp32) and the factor applied to cos/sin."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "default":
        return base_freq, 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
    f = rope.factor
    if rope.attention_factor is not None:
        att = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        att = yarn_mscale(f, rope.mscale) / yarn_mscale(f, rope.mscale_all_dim)
    else:
        att = yarn_mscale(f)

    def dim_for(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    lo, hi = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (original frequency), 0 = interpolate (frequency / factor)
    inv = (base_freq / f) * (1 - keep) + base_freq * keep
    return inv, att


@functools.lru_cache(maxsize=32)
def inv_freq_on(rope: RopeConfig, dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    inv, att = inv_freq_and_scale(rope, dim)
    return inv.to(device), att  # built once per device: no host-to-device copy inside a CUDA graph


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, dim/2] for integer positions [N], computed in fp32 then cast to `dtype`."""
    inv, att = inv_freq_on(cfg.rope, cfg.rope_dim, positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    return (freqs.cos() * att).to(dtype), (freqs.sin() * att).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [N, heads, dim] by per-token angles (cos/sin [N, dim/2]).

    half-split (Qwen): pair i is (x[i], x[i + dim/2]).  interleaved (DeepSeek): pair i is (x[2i], x[2i+1]).
    Output keeps the input's layout; q and k use the same layout, so q.k is what transformers computes.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
