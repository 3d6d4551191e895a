"""Mixture-of-experts: routing and the routed experts.

Legend: T tokens, E experts, A active experts per token (top-k), D hidden, I expert intermediate.

Routing rules (the spec every fast path must reproduce):
  softmax (Qwen3-MoE): p = softmax(x W^T), logits in the model dtype, softmax in fp32; pick the A largest p; weights = p of the picks,
      divided by their sum when `norm_topk_prob`.
  sigmoid (DeepSeek-V3, `noaux_tc`): s = sigmoid(x W^T) in fp32; choice = s + bias (the bias only
      selects, it never weights); with groups, each group's score is the sum of its 2 best `choice`
      values, the `topk_group` best groups stay and the other groups' experts get -inf; pick the A
      largest `choice`; weights = s of the picks, divided by (their sum + 1e-20) when
      `norm_topk_prob`, times `routed_scaling_factor`.
  ties: the lower expert index wins (a stable descending sort), for experts and for groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


def _topk_lowest_index_wins(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(cfg: ModelConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
    """x [T, D] -> (ids [T, A] int64, weights [T, A] fp32)."""
    A = cfg.top_k
    if cfg.score_func == "softmax":
        logits = F.linear(x, gate_w).float()  # as transformers: logits in the model dtype, softmax in fp32
        probs = torch.softmax(logits, dim=-1)
        ids = _topk_lowest_index_wins(probs, A)
        weights = probs.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights
    scores = torch.sigmoid(F.linear(x.float(), gate_w.float()))  # DeepSeek: the router runs in fp32
    choice = scores + bias.float()[None, :] if bias is not None else scores
    if cfg.n_group > 1:
        T, G = x.shape[0], cfg.n_group
        grouped = choice.view(T, G, -1)
        group_score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, _topk_lowest_index_wins(group_score, cfg.topk_group), True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, -1)
    ids = _topk_lowest_index_wins(choice, A)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def _expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


def experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_a weights[t, a] * FFN_{ids[t, a]}(x[t]); gate_up [E, 2I, D], down [E, D, I].

    Loops over the experts that received tokens (a host sync: the reference is not graph-capturable).
    Accumulates in fp32.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _expert_ffn(x[tok], gate_up[e], down[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None].float())
    return out.to(x.dtype)


def experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The same function without host syncs (CUDA-graph capturable): the T*A (token, expert) pairs are
    sorted by expert and run through `torch._grouped_mm` with device-side group offsets, so each
    selected expert's weights are read once. The combine is a deterministic sum over A (no atomics).
    act: "silu" (SwiGLU) or "situ" (K3's SiTU-GLU, reference/latent_moe.py)."""
    if act == "situ":
        from .latent_moe import situ_glu as glu
    elif act == "silu":
        def glu(g, u):
            return F.silu(g) * u
    else:
        raise ValueError(f"act must be 'silu' or 'situ', got {act!r}")
    T, A = ids.shape
    E = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync to size its output
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // A]  # [T*A, D]
    if x.is_cuda and x.dtype == torch.float32:
        # _grouped_mm has no fp32 CUDA kernel: gather each pair's expert (reads E_sel*A copies; fp32 only).
        h = torch.bmm(gate_up[flat[order]], xs[:, :, None])[..., 0]
        g, u = h.chunk(2, -1)
        y = torch.bmm(down[flat[order]], glu(g, u)[:, :, None])[..., 0]
    else:
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*A, 2I]
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(glu(g, u).contiguous(), down.transpose(1, 2), offs=offs)  # [T*A, D]
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(T, A, -1).float() * weights[..., None].float()).sum(1).to(x.dtype)
