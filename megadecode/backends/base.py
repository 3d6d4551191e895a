"""What the engine asks of an executor (`Executor`), and the defaults every executor inherits (`ExecutorBase`).

An executor runs one model's DecodePlan over its weights and cache: a prefill (the prompts' tokens in one step) and
decode steps (one token per running sequence), each returning the next-token logits. Everything else the engine
needs is here, so that it never probes an executor for what it can do:

- `graph_lengths`: the kv_len values of the graphs it captures for a batch (none: it runs eagerly), so the engine
  compiles and captures them before any timed or served step;
- `set_sampling`: whether it samples inside its decode step for these sampling parameters (then each step's
  tokens and logprobs are in `sampled`, and `seed` is the step's noise seed, written in place);
- `first_nonfinite`: per logits row, the position whose logits first held NaN or inf (-1: none);
- `check_errors`: raise what the device reported during the steps (the megakernel's timed-out waits);
- `supports(cfg)`: None when it runs this model, else why not (one line), before any weight is touched;
- `build_extra(...)`: memory its build needs beside the weights and cache, for the fit check.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig
from ..step import Step


@runtime_checkable
class Executor(Protocol):
    name: str
    first_nonfinite: torch.Tensor
    seed: torch.Tensor | None
    sampled: tuple[torch.Tensor, torch.Tensor] | None

    def prefill(self, step: Step) -> torch.Tensor: ...

    def decode(self, step: Step) -> torch.Tensor: ...

    def graph_lengths(self, batch: int, kv_lo: int, kv_hi: int) -> list[int]: ...

    def set_sampling(self, params, batch: int = 1) -> bool: ...

    def check_errors(self) -> None: ...

    @classmethod
    def build_extra(cls, cfg: ModelConfig, device, dtype: torch.dtype, shard) -> tuple[int, str] | None: ...

    @classmethod
    def supports(cls, cfg: ModelConfig) -> str | None: ...


class ExecutorBase:
    """The defaults: no in-step sampling, nothing reported by the device, every family runs."""

    name = "?"
    seed: torch.Tensor | None = None
    sampled: tuple[torch.Tensor, torch.Tensor] | None = None
    # Whether a decode step may feed several consecutive positions of one sequence (the same slot on several rows),
    # each row attending causally to the step's earlier rows: true where every layer's attention writes all the
    # step's cache entries before any row reads the cache (speculative.py runs its verify step so)
    decode_verifies = True

    def set_sampling(self, params, batch: int = 1) -> bool:
        """Sample inside the decode step for `params` when this executor can; False: the engine samples."""
        return False

    def check_errors(self) -> None:
        """Raise what the device reported during the steps run so far (nothing here)."""

    @classmethod
    def build_extra(cls, cfg: ModelConfig, device, dtype: torch.dtype, shard) -> tuple[int, str] | None:
        """Memory its build needs for a while beside the weights and cache, (bytes, why), or None
        (memory.check_fits adds it before anything is built)."""
        return None

    @classmethod
    def supports(cls, cfg: ModelConfig) -> str | None:
        """None when this executor runs `cfg`'s model, else why not: the family registry's word
        (config/registry.py), which an executor may narrow further."""
        from ..config.registry import executor_refusal

        return executor_refusal(cls.name, cfg.family)
