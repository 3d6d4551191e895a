"""Routing: which experts each token runs, and with what weight.

Legend: T tokens, E experts, A active experts per token (top-k), D hidden.

Routing rules (the spec every fast path must reproduce):
  softmax (Qwen3-MoE): p = softmax(x W^T), logits in the model dtype, softmax in fp32; pick the A largest p; weights = p of the picks,
      divided by their sum when `norm_topk_prob`.
  sigmoid (DeepSeek-V3, `noaux_tc`; Kimi K3's Stable LatentMoE): s = sigmoid(x W^T) in fp32; choice = s + bias (the bias only
      selects, it never weights); with groups, each group's score is the sum of its 2 best `choice`
      values, the `topk_group` best groups stay and the other groups' experts get -inf; pick the A
      largest `choice`; weights = s of the picks, divided by (their sum + 1e-20) when
      `norm_topk_prob`, times `routed_scaling_factor`.
  ties: the lower expert index wins (a stable descending sort), for experts and for groups.

`routing_margin` says how close each token's selection is to changing (the harness's near-tie test).

`route` reads only these attributes of `cfg`: top_k, score_func, n_group, topk_group, norm_topk_prob,
routed_scaling_factor (a ModelConfig, or reference.latent_moe.LatentMoEParams).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _topk_lowest_index_wins(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(cfg, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
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


def routing_margin(cfg, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, D] -> [T] fp32: a lower bound on how far any router logit of the token must move before `route`
    picks a different set of experts (or groups). softmax: the gap between the A-th and (A+1)-th logits.
    sigmoid: 4 x the gap between the A-th and (A+1)-th `choice` values (sigmoid's slope is at most 1/4) and, with
    groups, the gap between the `topk_group`-th and next group scores (a group score is the sum of two choices, so
    two groups' scores drift apart by at most the logit change). inf where nothing can change (A = E).
    A fast path whose logits differ from the reference by less than this picks the same experts; where the
    margin is smaller than the path's error, a different pick is a legitimate near tie, not a bug."""
    A = cfg.top_k
    inf = torch.full((x.shape[0],), float("inf"), device=x.device)
    if cfg.score_func == "softmax":
        logits = F.linear(x, gate_w).float()
        if logits.shape[-1] <= A:
            return inf
        v = torch.sort(logits, dim=-1, descending=True).values
        return v[:, A - 1] - v[:, A]
    scores = torch.sigmoid(F.linear(x.float(), gate_w.float()))
    choice = scores + bias.float()[None, :] if bias is not None else scores
    margin = inf
    if cfg.n_group > 1:
        T, G = x.shape[0], cfg.n_group
        grouped = choice.view(T, G, -1)
        group_score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
        if cfg.topk_group < G:
            gs = torch.sort(group_score, dim=-1, descending=True).values
            margin = gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, _topk_lowest_index_wins(group_score, cfg.topk_group), True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, -1)
    v = torch.sort(choice, dim=-1, descending=True).values
    if v.shape[-1] > A:
        gap = 4 * (v[:, A - 1] - v[:, A])  # -inf past the kept groups: an inf gap
        margin = torch.minimum(margin, torch.nan_to_num(gap, posinf=float("inf")))
    return margin
