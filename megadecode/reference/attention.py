"""Attention over the cache: GQA with q/k norm (Qwen3-MoE) and MLA in the absorbed form (DeepSeek-V3).

Every new token first writes its key/value (or latent) into the cache at (slot, position), then attends
to positions [0, position] of its own slot. Dimensions: N new tokens, H query heads, K kv heads,
G = H / K, d head dim, L cache positions read, C kv_lora_rank (latent), R rope dims, V v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..step import Step
from .norm import rms_norm
from .rope import apply_rope


def _masked_softmax(scores: torch.Tensor, positions: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """scores [N, ..., L]; token n sees cache positions <= positions[n]. Softmax in fp32."""
    L = scores.shape[-1]
    hidden = torch.arange(L, device=scores.device)[None, :] > positions[:, None]  # [N, L]
    shape = (scores.shape[0],) + (1,) * (scores.dim() - 2) + (L,)
    scores = scores.float().masked_fill(hidden.view(shape), float("-inf"))
    return torch.softmax(scores, dim=-1).to(out_dtype)


def _per_sequence(step: Step, fn):
    """Run fn(token_slice, slot_index_tensor) per prefill segment, or once for a decode step
    (each token its own sequence: the cache is gathered with the tokens' slots)."""
    if step.segments is None:
        return fn(slice(None), slice(0, step.num_tokens) if step.contiguous_slots else step.slots)
    outs = [fn(slice(s, e), step.slots[s:s + 1]) for s, e, _ in step.segments]
    return torch.cat(outs, 0)


def gqa_attention(cfg: ModelConfig, w: dict, prefix: str, x: torch.Tensor, step: Step, rope,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, core=None) -> torch.Tensor:
    """Qwen3-MoE attention. x [N, D] -> [N, D]. Caches [S, Lmax, K, d]. rope = (cos, sin) [N, d/2].
    `core`: for decode steps, a replacement of the attention over the cache,
    core(qg [N, K, G, d], k_cache, v_cache, step, scale) -> o [N, K, G, d] (backends/fused/kernels/gqa.py)."""
    N, H, K, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = prefix
    q = rms_norm(F.linear(x, w[f"{p}.q_proj.weight"]).view(N, H, d), w[f"{p}.q_norm.weight"], cfg.rms_norm_eps)
    k = rms_norm(F.linear(x, w[f"{p}.k_proj.weight"]).view(N, K, d), w[f"{p}.k_norm.weight"], cfg.rms_norm_eps)
    v = F.linear(x, w[f"{p}.v_proj.weight"]).view(N, K, d)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False)
    k_cache[step.slots, step.positions] = k
    v_cache[step.slots, step.positions] = v
    qg = q.view(N, K, H // K, d)
    if step.segments is None:
        # Decode: one query per sequence. The G query heads of a kv head act as G query rows of one
        # attention over that head's cache (read in place, no copy); fp32 softmax inside SDPA.
        if core is not None:
            o = core(qg, k_cache, v_cache, step, d ** -0.5).to(x.dtype)
            return F.linear(o.reshape(N, H * d), w[f"{p}.o_proj.weight"])
        rows = slice(0, N) if step.contiguous_slots else step.slots
        Kc = k_cache[rows, :step.kv_len].transpose(1, 2)  # [N, K, L, d]
        Vc = v_cache[rows, :step.kv_len].transpose(1, 2)
        visible = torch.arange(step.kv_len, device=x.device)[None, :] <= step.positions[:, None]  # [N, L]
        o = F.scaled_dot_product_attention(qg, Kc, Vc, attn_mask=visible[:, None, None, :], scale=d ** -0.5)
        return F.linear(o.reshape(N, H * d), w[f"{p}.o_proj.weight"])

    def attend(rows, slots):
        Kc = k_cache[slots, :step.kv_len].permute(0, 2, 3, 1)  # [M, K, d, L], M = tokens or 1
        Vc = v_cache[slots, :step.kv_len].transpose(1, 2)  # [M, K, L, d]
        probs = _masked_softmax((qg[rows] @ Kc) * d ** -0.5, step.positions[rows], x.dtype)  # [n, K, G, L]
        return (probs @ Vc).reshape(-1, H * d)

    return F.linear(_per_sequence(step, attend), w[f"{p}.o_proj.weight"])


def mla_attention(cfg: ModelConfig, w: dict, prefix: str, x: torch.Tensor, step: Step, rope,
                  latent_cache: torch.Tensor, core=None) -> torch.Tensor:
    """DeepSeek-V3 MLA, absorbed: the cache holds C + R values per token ([S, Lmax, C + R]) and the
    per-head key/value up-projections (kv_b_proj) are folded into the query and the output.
    rope = (cos, sin), or None for MLA without positional encoding (kimi_linear: nothing is rotated).
    kimi_k3's output gate (`cfg.mla_output_gate`): o_proj(o * sigmoid(x gate_proj^T)), gate_proj [H*V, D].
    `core`: for decode steps, a replacement of the attention over the cache,
    core(q_lat [N, H, C], q_pe [N, H, R], latent_cache, step, scale) -> o_lat [N, H, C] (backends/fused/kernels/mla.py)."""
    N, H = x.shape[0], cfg.num_heads
    C, R, P, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    p, eps = prefix, cfg.rms_norm_eps
    if cfg.q_lora_rank is None:
        q = F.linear(x, w[f"{p}.q_proj.weight"])
    else:
        q = F.linear(rms_norm(F.linear(x, w[f"{p}.q_a_proj.weight"]), w[f"{p}.q_a_layernorm.weight"], eps),
                     w[f"{p}.q_b_proj.weight"])
    q = q.view(N, H, P + R)
    q_nope, q_pe = q[..., :P], q[..., P:]
    kv = F.linear(x, w[f"{p}.kv_a_proj_with_mqa.weight"])
    latent = rms_norm(kv[:, :C], w[f"{p}.kv_a_layernorm.weight"], eps)  # [N, C]
    if rope is not None:
        cos, sin = rope
        q_pe = apply_rope(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = apply_rope(kv[:, None, C:], cos, sin, cfg.rope_interleave)[:, 0]  # one shared rope key per token
    else:  # NoPE (kimi_linear): the shared key part is cached and scored unrotated
        k_pe = kv[:, C:]
    latent_cache[step.slots, step.positions] = torch.cat((latent, k_pe), -1)

    w_kv = w[f"{p}.kv_b_proj.weight"].view(H, P + V, C)
    w_uk, w_uv = w_kv[:, :P], w_kv[:, P:]  # [H, P, C], [H, V, C]
    q_lat = torch.einsum("nhp,hpc->nhc", q_nope, w_uk)  # query moved into the latent space

    def attend(rows, slots):
        cache = latent_cache[slots, :step.kv_len]  # [M, L, C + R]
        lat, pe = cache[..., :C], cache[..., C:]
        scores = q_lat[rows] @ lat.transpose(1, 2) + q_pe[rows] @ pe.transpose(1, 2)  # [n, H, L]
        probs = _masked_softmax(scores * cfg.softmax_scale, step.positions[rows], x.dtype)
        return probs @ lat  # [n, H, C]

    if core is not None and step.segments is None:
        o_lat = core(q_lat, q_pe, latent_cache, step, cfg.softmax_scale).to(q_lat.dtype)
    else:
        o_lat = _per_sequence(step, attend)
    o = torch.einsum("nhc,hvc->nhv", o_lat, w_uv).reshape(N, H * V)
    if cfg.mla_output_gate:  # kimi_k3: per (head, v) element, gated by the layer input x
        o = o * torch.sigmoid(F.linear(x, w[f"{p}.gate_proj.weight"]))
    return F.linear(o, w[f"{p}.o_proj.weight"])
