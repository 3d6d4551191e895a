"""Next-token selection on the device, with no host synchronisation: greedy, temperature, top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.greedy and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0 (greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32: log p(token) under the model, T = 1)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1:
            p_sorted, idx = probs.sort(dim=-1, descending=True)
            before = p_sorted.cumsum(-1) - p_sorted  # mass strictly above each token
            p_sorted = p_sorted.masked_fill(before >= params.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
        # argmax(p / Exp(1)) is a draw from p (exponential race), without torch.multinomial's sync.
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        # A zero draw would make 0/0 = NaN, which argmax picks: excluded tokens must never win.
        tokens = (probs / noise).masked_fill(probs <= 0, -1.0).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
