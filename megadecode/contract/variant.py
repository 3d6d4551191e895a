"""Variant and Manifest: a fast path of plan ops, and what it declares about itself (see the package doc)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config.registry import FAMILIES
from ..config import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class ManifestViolation(RuntimeError):
    """A variant touched a buffer its manifest does not own, or left part of its outputs unwritten."""


def dtype_name(dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else str(dtype)


@dataclass(frozen=True)
class Scope:
    """Where a variant may run. `dims(cfg)` returns why the model's dimensions are out of scope, or None."""

    families: tuple[str, ...] = FAMILIES[:2]  # registered families (config/registry.py); default qwen3_moe, deepseek_v3
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    devices: tuple[str, ...] = ("cpu", "cuda")
    batch: tuple[int, int] = (1, 4096)  # inclusive range of tokens per step
    arch: str | None = None  # e.g. "sm_90": the GPU architecture it needs on cuda; None = any
    dims: Callable[[ModelConfig], str | None] | None = None
    # (ModelConfig field, lo, hi): inclusive ranges the kernels handle, declared as data so that the harness
    # can test at the edges (validate/cases.py) as well as refuse beyond them
    limits: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self):
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"Scope names unregistered families {unknown} (config/registry.py: {', '.join(FAMILIES)})")

    def describe(self) -> str:
        parts = [f"families={','.join(self.families)}", f"dtypes={','.join(self.dtypes)}",
                 f"devices={','.join(self.devices)}", f"batch={self.batch[0]}..{self.batch[1]}"]
        if self.arch:
            parts.append(f"arch={self.arch}")
        parts += [f"{f}={lo}..{hi}" for f, lo, hi in self.limits]
        if self.dims is not None:
            parts.append(f"dims={getattr(self.dims, '__doc__', None) or self.dims.__name__}")
        return " ".join(parts)


# A Scope.dims for the variants that read float (16/32-bit) expert stacks; FP8 experts have their own variant.
def float_experts(cfg: ModelConfig) -> str | None:
    """float routed experts, not FP8"""
    return "FP8 experts (triton-fp8-experts runs them)" if cfg.expert_quant == "fp8" else None


@dataclass(frozen=True)
class Manifest:
    name: str
    description: str
    replaces: tuple[str, ...]  # plan op kinds
    scope: Scope = field(default_factory=Scope)
    sources: tuple[str, ...] = ()  # files the variant owns (paths from the repository root)
    baseline: str = "torch"  # the executor it is validated against
    uses_triton: bool = False  # on cpu it then needs the Triton interpreter
    graph_capturable: bool = True  # claims CUDA-graph capture (checked on the GPU by graph replay)
    # The compiled kernels it runs: a function returning one spec (contract.kernels) per kernel and launch
    # specialization, every code path included. None: it runs no compiled kernel (plain torch); registration
    # refuses None for a variant that uses Triton, and an empty list for any.
    kernels: Callable[[], list] | None = None
    # Outputs beyond the op's that the variant writes when the caller hands them in (contract/outputs.py
    # SIDE_OUTPUTS: LM_HEAD's greedy tokens and their logprobs, what the fused executor samples from); the
    # validation harness hands them in, guarded and poisoned like the op's, and compares them with the reference.
    side_outputs: tuple[str, ...] = ()
    # The scratch buffers its kernels write (partials, workspaces), as scratch(cfg, op, inputs) -> {name: (shape,
    # dtype)}: a caller may hand them in through `outputs` as "scratch.<name>" (the variant allocates its own
    # otherwise); the validation harness does, inside guard regions, so that a kernel overflowing its scratch
    # fails a named check instead of corrupting the heap (CPU) or racing with another buffer (GPU).
    scratch: Callable[..., dict] | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "replaces": list(self.replaces),
                "scope": self.scope.describe(), "sources": list(self.sources), "baseline": self.baseline,
                "graph_capturable": self.graph_capturable, "side_outputs": list(self.side_outputs),
                "kernels": None if self.kernels is None else [
                    f"{k.name} {k.path_values() if hasattr(k, 'path_values') else ''}".strip() for k in self.kernels()]}


def triton_interpreted(fn) -> bool:
    """Whether a @triton.jit function runs under the Triton interpreter (on the CPU). Both it and Triton's
    own library functions (tl.max, tl.sum: decorated when triton.language is first imported) must have
    been decorated under TRITON_INTERPRET=1: importing triton earlier without it breaks the interpreter."""
    import triton.language as tl

    return type(fn).__name__ == type(tl.max).__name__ == "InterpretedFunction"


@dataclass
class Variant:
    manifest: Manifest
    impl: Callable  # impl(op, inputs, weights, outputs, cfg, step, cache=None)
    kernel: object = None  # the Triton kernel, for the interpreter check on cpu

    @property
    def name(self) -> str:
        return self.manifest.name

    def triton_kernel(self):
        """The kernel whose decoration tells whether Triton runs interpreted here: `kernel`, else the first
        declared one."""
        if self.kernel is not None or self.manifest.kernels is None:
            return self.kernel
        return next((k.fn for k in self.manifest.kernels() if hasattr(k, "fn")), None)

    def run(self, op, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
            outputs: dict[str, torch.Tensor], cfg: ModelConfig, step, cache=None) -> None:
        self.impl(op, inputs, weights, outputs, cfg, step, cache)

    def supports(self, cfg: ModelConfig, dtype, batch: int, device) -> str | None:
        """None when the variant can run this configuration, else the reason it cannot."""
        s, dev = self.manifest.scope, torch.device(device).type
        if cfg.family not in s.families:
            return f"family {cfg.family} not in scope ({', '.join(s.families)})"
        if dtype_name(dtype) not in s.dtypes:
            return f"dtype {dtype_name(dtype)} not in scope ({', '.join(s.dtypes)})"
        if dev not in s.devices:
            return f"device {dev} not in scope ({', '.join(s.devices)})"
        if not s.batch[0] <= batch <= s.batch[1]:
            return f"batch {batch} outside {s.batch[0]}..{s.batch[1]}"
        if dev == "cuda" and s.arch is not None:
            if not torch.cuda.is_available():
                return "no CUDA device"
            major, minor = torch.cuda.get_device_capability()
            if f"sm_{major}{minor}" != s.arch:
                return f"needs {s.arch}, this GPU is sm_{major}{minor}"
        if dev == "cpu" and self.manifest.uses_triton and not triton_interpreted(self.triton_kernel()):
            return ("Triton on cpu needs TRITON_INTERPRET=1 set before triton and megadecode.backends.fused.kernels are "
                    f"first imported (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now)")
        if dev == "cpu" and self.manifest.uses_triton and dtype_name(dtype) == "bfloat16":
            return "the Triton interpreter computes bf16 arithmetic wrongly: test bf16 on the GPU"
        for f, lo, hi in s.limits:
            if not lo <= getattr(cfg, f) <= hi:
                return f"{f} {getattr(cfg, f)} outside {lo}..{hi}"
        if s.dims is not None:
            return s.dims(cfg)
        return None
