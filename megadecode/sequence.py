"""One request while it is served: its prompt and the tokens generated so far, its sampling parameters and stop
criteria, and the cache slot it holds. Plain Python, no tensors: the scheduler decides with it, the model runner
fills it (nano-vllm's Sequence)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from .sampling import SamplingParams

GREEDY = SamplingParams(greedy=True)
_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no cache slot yet
    RUNNING = "running"  # holds a slot: prefilled (or about to be) and decoding
    FINISHED = "finished"


# Why a sequence finished (OpenAI's finish_reason where one applies)
STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"


@dataclass(eq=False)
class Sequence:
    """`max_tokens` new tokens at most; a token in `stop_ids` ends the sequence (it is kept, as the EOS token the
    model chose). `seed`: this request's sampling generator (None: a fresh random one); greedy draws nothing."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams = GREEDY
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: int | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    generator: object = None  # the model runner's per-request generator; opaque here
    counted: bool = False  # the model runner keeps its token counts on the device (penalties): set from its prompt
    min_tokens: int = 0  # stop ids (EOS included) are not drawn before this many new tokens
    sampled: int = 0  # tokens the model runner has drawn for it, read or still in flight
    top_logprobs: int = 0  # the most likely tokens reported beside each generated one (sampling.MAX_TOP_LOGPROBS)
    guide: object = None  # structured output (structured.Guide): the tokens allowed next, filled before each sampling

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, logprob: float) -> str | None:
        """Record a generated token; returns why the sequence is done with it (STOP, LENGTH; ERROR with `error`
        set: a token its guide does not allow), or None. A guide that took its stop token ends the sequence."""
        self.output.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            return STOP
        if self.guide is not None:
            if not self.guide.accept(token):
                self.error = f"generated token {token} is not allowed by the request's structured output guide"
                return ERROR
            if self.guide.done:
                return STOP
        if len(self.output) >= self.max_tokens:
            return LENGTH
        return None
