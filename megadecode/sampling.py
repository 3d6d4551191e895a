"""Next-token selection on the device, with no host synchronisation: penalties, logit bias, greedy, temperature,
min-p, top-k, top-p.

The order is vLLM's: the penalties, from each row's token counts on the device (`Counts`): repetition (a logit of a
token in the prompt or the output divided by it when positive, multiplied when not), frequency (minus it times
the token's count in the output) and presence (minus it once the token is in the output); then the request's logit
bias (OpenAI's `logit_bias`); then temperature, min_p (drop tokens below min_p x the top token's probability),
top_k (keep the tokens at least as probable as the k-th: ties at the k-th all stay), top_p (the nucleus of what is
left, renormalized), and a draw from what remains.

`sample` selects for a batch that shares one SamplingParams and one generator (Engine.generate); `sample_rows`
for a batch whose rows each have their own params and generator (the server: one generator per request, so a
seeded request draws the same tokens whatever it is batched with). Both run the same selection (`_select`), and
a row drawn by `sample_rows` with generator g equals `sample` of that row alone with g."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


MAX_TOP_LOGPROBS = 20  # alternatives reported per token at most (vLLM's default max_logprobs)
GREEDY_BELOW = 1e-5  # temperatures in [0, this) are argmax (vLLM's choice): logits / T would overflow fp32 near 0


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits before any selection (greedy too); the reported logprobs stay the
    # model's. Ids are checked against the vocabulary where the logits are (`check_bias`)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: in [-2, 2], once a token is in the output
    frequency_penalty: float = 0.0  # OpenAI's: in [-2, 2], per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM's (HF's): > 0, on the prompt's and the output's tokens; 1: none

    def __post_init__(self):
        if not self.greedy and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0 (greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: every token), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0 < r and math.isfinite(r)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {r!r}")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or pair[0] < 0 or not isinstance(pair[1], (int, float))
                    or isinstance(pair[1], bool) or not math.isfinite(pair[1])):
                raise ValueError(f"logit_bias must hold (token id >= 0, finite bias) pairs, got {pair!r}")

    @property
    def truncates(self) -> bool:
        """Whether a draw is cut to part of the vocabulary (top_p, top_k or min_p), or biased (logit_bias): the
        in-step samplers (backends/fused/kernels/lm_head.py, the mega executor) take only greedy and plain
        temperature sampling of the model's logits."""
        return bool(self.logit_bias) or self.penalized or not self.greedy and (
            self.top_p < 1 or self.top_k > 0 or self.min_p > 0)

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies: the rows' token counts are needed."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Counts:
    """Per row of a batch, on the device: how often each token was generated (`output` [R, V] fp32) and whether it
    is in the prompt (`prompt` [R, V] bool), what the penalties read. `start(rows, prompts)` sets rows from their
    prompts; `add(rows, tokens)` counts a step's tokens (device tensors: no host sync)."""

    def __init__(self, rows: int, vocab: int, device):
        self.output = torch.zeros(rows, vocab, device=device)
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)

    def start(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        dev = self.output.device
        r = to_device(list(rows), torch.int64, dev)
        self.output[r] = 0.0
        self.prompt[r] = False
        pr = to_device([i for i, p in zip(rows, prompts) for _ in p], torch.int64, dev)
        pt = to_device([t for p in prompts for t in p], torch.int64, dev)
        self.prompt.index_put_((pr, pt), torch.ones_like(pt, dtype=torch.bool))

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.output.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)


def _penalized(logits: torch.Tensor, params: Sequence[SamplingParams], counts: Counts | None,
               rows: Sequence[int] | None) -> torch.Tensor:
    """logits [B, V] with each row's penalties applied from counts' row rows[i] (a copy), or `logits` when none
    applies."""
    pen = [i for i, p in enumerate(params) if p.penalized]
    if not pen:
        return logits
    if counts is None or rows is None:
        raise ValueError("presence, frequency and repetition penalties need the rows' token counts (Counts)")
    dev = logits.device
    b = to_device(pen, torch.int64, dev)
    r = to_device([rows[i] for i in pen], torch.int64, dev)
    out, seen = counts.output[r], counts.prompt[r]
    rep = to_device([[float(params[i].repetition_penalty)] for i in pen], torch.float32, dev)
    freq = to_device([[float(params[i].frequency_penalty)] for i in pen], torch.float32, dev)
    pres = to_device([[float(params[i].presence_penalty)] for i in pen], torch.float32, dev)
    x = logits[b]
    x = torch.where(seen | (out > 0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * out - pres * (out > 0).float()
    logits = logits.clone()
    logits[b] = x
    return logits


def _biased(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, V] (fp32) with params[i].logit_bias added to row rows[i] (a copy; `logits` itself untouched),
    or `logits` when no row has a bias. One scatter-add of device tensors: no host sync."""
    pairs = [(r, t, b) for r, p in zip(rows, params) for t, b in p.logit_bias]
    if not pairs:
        return logits
    V = logits.shape[-1]
    bad = next((t for _, t, _ in pairs if t >= V), None)
    if bad is not None:
        raise ValueError(f"logit_bias names token id {bad}, outside the vocabulary [0, {V})")
    dev = logits.device
    r = to_device([r for r, _, _ in pairs], torch.int64, dev)
    t = to_device([t for _, t, _ in pairs], torch.int64, dev)
    b = to_device([float(b) for _, _, b in pairs], torch.float32, dev)
    return logits.index_put((r, t), b, accumulate=True)


def _check(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    return logits.float()


def _select(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None, noise: torch.Tensor,
            top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [B] drawn from `_probs` (the same arguments) by the exponential race: argmax(p / noise), noise [B, V]
    ~ Exp(1), which draws from p without torch.multinomial's host sync (p need not sum to 1)."""
    return race(_probs(logits, temperature, top_p, top_k, min_p), noise)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Tokens [B] drawn from the rows of probs [B, V] (need not sum to 1) by the exponential race, noise [B, V] ~
    Exp(1)."""
    # A zero draw would make 0/0 = NaN, which argmax picks: excluded tokens must never win.
    return (probs / noise).masked_fill(probs <= 0, -1.0).argmax(-1)


def _probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
           top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / temperature) (temperature [B, 1]), cut (module doc) to the tokens of probability >= min_p
    [B, 1] x the top one's, then to those at least as probable as the top_k [B, 1]-th (int64, V: every token), then
    to the nucleus of mass top_p [B, 1] of what is left (a row whose top_p is inf keeps every token); None: no row
    is cut that way. Rows are not renormalised after the cuts."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if top_p is not None or top_k is not None:
        p_sorted, idx = probs.sort(dim=-1, descending=True)
        if top_k is not None:
            p_sorted = p_sorted.masked_fill(p_sorted < p_sorted.gather(-1, top_k - 1), 0.0)
        if top_p is not None:
            p_sorted = p_sorted / p_sorted.sum(-1, keepdim=True)  # the nucleus of what is left
            before = p_sorted.cumsum(-1) - p_sorted  # mass strictly above each token
            p_sorted = p_sorted.masked_fill(before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
    return probs


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws each row of logits [B, V] from under `params` (no penalty or bias: those
    need token counts), renormalised: [B, V] fp32 summing to 1 (greedy: one-hot at the argmax)."""
    logits = _check(logits)
    if params.penalized or params.logit_bias:
        raise ValueError("target_probs takes no penalties or logit bias")
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    B, V = logits.shape
    dev = logits.device
    p = _probs(logits, torch.full((B, 1), params.temperature, device=dev),
               torch.full((B, 1), params.top_p, device=dev) if params.top_p < 1 else None,
               torch.full((B, 1), min(params.top_k, V), device=dev) if params.top_k else None,
               torch.full((B, 1), params.min_p, device=dev) if params.min_p else None)
    return p / p.sum(-1, keepdim=True)


def _banned(logits: torch.Tensor, ban: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """logits with row i's tokens ban[i] at -inf (a copy; min_tokens: EOS and stop ids before the minimum), or
    `logits` when nothing is banned."""
    pairs = [(r, t) for r, ids in enumerate(ban or ()) for t in ids]
    if not pairs:
        return logits
    dev = logits.device
    r = to_device([r for r, _ in pairs], torch.int64, dev)
    t = to_device([t for _, t in pairs], torch.int64, dev)
    return logits.index_put((r, t), torch.full((len(pairs),), -math.inf, device=dev))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           counts: Counts | None = None, ban: Sequence[Sequence[int]] | None = None):
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32: log p(token) under the model, T = 1, before any
    logit bias or penalty). `counts`: the rows' token counts (row i of counts for row i), for the penalties; `ban`:
    per row, tokens it may not draw (after the penalties and the bias)."""
    logits = _check(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    B = logits.shape[0]
    logits = _banned(_biased(_penalized(logits, [params] * B, counts, range(B)), range(B), [params] * B), ban)
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        B, V = logits.shape
        temperature = torch.full((B, 1), params.temperature, device=logits.device)
        top_p = torch.full((B, 1), params.top_p, device=logits.device) if params.top_p < 1 else None
        top_k = torch.full((B, 1), min(params.top_k, V), device=logits.device) if params.top_k else None
        min_p = torch.full((B, 1), params.min_p, device=logits.device) if params.min_p else None
        noise = torch.empty_like(logits).exponential_(1.0, generator=generator)
        tokens = _select(logits, temperature, top_p, noise, top_k, min_p)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], counts: Counts | None = None,
                rows: Sequence[int] | None = None, ban: Sequence[Sequence[int]] | None = None):
    """`sample` with params[i] and generators[i] for row i of logits [B, V]: one exponential draw of V values
    per sampled row from its own generator (greedy rows draw nothing), so a row's tokens do not depend on the
    other rows. `counts` and `rows`: row i's token counts are counts' row rows[i] (the penalties); `ban`: per row,
    tokens it may not draw. Returns
    (tokens [B] int64, logprobs [B] fp32)."""
    logits = _check(logits)
    B, V = logits.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows of logits need {B} params and generators, got {len(params)} and "
                         f"{len(generators)}")
    logprobs = torch.log_softmax(logits, dim=-1)
    logits = _banned(_biased(_penalized(logits, params, counts, rows), range(B), params), ban)
    tokens = logits.argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        dev = logits.device
        sub = logits[drawn] if len(drawn) < B else logits
        temperature = to_device([[params[i].temperature] for i in drawn], torch.float32, dev)
        top_p = None
        if any(params[i].top_p < 1 for i in drawn):  # inf: the row keeps every token, as `sample` with top_p 1
            top_p = to_device([[params[i].top_p if params[i].top_p < 1 else math.inf] for i in drawn],
                               torch.float32, dev)
        top_k = min_p = None
        if any(params[i].top_k for i in drawn):  # V: the row keeps every token
            top_k = to_device([[min(params[i].top_k or V, V)] for i in drawn], torch.int64, dev)
        if any(params[i].min_p for i in drawn):
            min_p = to_device([[params[i].min_p] for i in drawn], torch.float32, dev)
        noise = torch.empty_like(sub)
        for r, i in enumerate(drawn):
            noise[r].exponential_(1.0, generator=generators[i])
        picked = _select(sub, temperature, top_p, noise, top_k, min_p)
        if len(drawn) < B:
            tokens[to_device(drawn, torch.int64, dev)] = picked
        else:
            tokens = picked
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row under the model (T = 1, before any logit bias or penalty, as the
    sampled token's logprob is reported): (logprobs [B, k] fp32, token ids [B, k] int64), most likely first."""
    if not 1 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs: k must be in [1, {MAX_TOP_LOGPROBS}], got {k}")
    vals, ids = torch.log_softmax(_check(logits).float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return vals, ids


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the GPU (a blocking copy to CUDA synchronizes the stream:
    the server queues the next step before it reads this one's tokens)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
