"""Next-token selection on the device, with no host synchronisation: greedy, temperature, top-p.

`sample` selects for a batch that shares one SamplingParams and one generator (Engine.generate); `sample_rows`
for a batch whose rows each have their own params and generator (the server: one generator per request, so a
seeded request draws the same tokens whatever it is batched with). Both run the same selection (`_select`), and
a row drawn by `sample_rows` with generator g equals `sample` of that row alone with g."""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def _check(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    return logits.float()


def _select(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
            noise: torch.Tensor) -> torch.Tensor:
    """Tokens [B] drawn from softmax(logits / temperature) (temperature [B, 1]), each row cut to its nucleus of
    mass top_p [B, 1] (None: no row is cut; a row whose top_p is inf keeps every token), with the exponential
    race: argmax(p / noise), noise [B, V] ~ Exp(1), which draws from p without torch.multinomial's host sync."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p is not None:
        p_sorted, idx = probs.sort(dim=-1, descending=True)
        before = p_sorted.cumsum(-1) - p_sorted  # mass strictly above each token
        p_sorted = p_sorted.masked_fill(before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
    # A zero draw would make 0/0 = NaN, which argmax picks: excluded tokens must never win.
    return (probs / noise).masked_fill(probs <= 0, -1.0).argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32: log p(token) under the model, T = 1)."""
    logits = _check(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        B = logits.shape[0]
        temperature = torch.full((B, 1), params.temperature, device=logits.device)
        top_p = torch.full((B, 1), params.top_p, device=logits.device) if params.top_p < 1 else None
        noise = torch.empty_like(logits).exponential_(1.0, generator=generator)
        tokens = _select(logits, temperature, top_p, noise)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]):
    """`sample` with params[i] and generators[i] for row i of logits [B, V]: one exponential draw of V values
    per sampled row from its own generator (greedy rows draw nothing), so a row's tokens do not depend on the
    other rows. Returns (tokens [B] int64, logprobs [B] fp32)."""
    logits = _check(logits)
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows of logits need {B} params and generators, got {len(params)} and "
                         f"{len(generators)}")
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        dev = logits.device
        sub = logits[drawn] if len(drawn) < B else logits
        temperature = _to_device([[params[i].temperature] for i in drawn], torch.float32, dev)
        top_p = None
        if any(params[i].top_p < 1 for i in drawn):  # inf: the row keeps every token, as `sample` with top_p 1
            top_p = _to_device([[params[i].top_p if params[i].top_p < 1 else math.inf] for i in drawn],
                               torch.float32, dev)
        noise = torch.empty_like(sub)
        for r, i in enumerate(drawn):
            noise[r].exponential_(1.0, generator=generators[i])
        picked = _select(sub, temperature, top_p, noise)
        if len(drawn) < B:
            tokens[_to_device(drawn, torch.int64, dev)] = picked
        else:
            tokens = picked
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the GPU (a blocking copy to CUDA synchronizes the stream:
    the server queues the next step before it reads this one's tokens)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
