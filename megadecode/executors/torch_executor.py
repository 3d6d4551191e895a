"""The `torch` executor: every plan op in plain PyTorch, in order. The reference and HF-parity path."""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..plan import DecodePlan
from ..step import Step
from .torch_ops import OP_IMPLS, StepContext


class TorchExecutor:
    name = "torch"
    experts_impl = "reference"

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache):
        self.plan, self.cfg, self.weights, self.cache = plan, plan.config, weights, cache

    def run_ops(self, step: Step, hook=None) -> StepContext:
        """Run the plan; `hook(op, ctx)` is called after each op (the harness diffs buffers there)."""
        ctx = StepContext(self.cfg, self.weights, self.cache, step, self.experts_impl)
        for op in self.plan.ops:
            OP_IMPLS[op.kind](ctx, op)
            if hook is not None:
                hook(op, ctx)
        return ctx

    @torch.inference_mode()
    def prefill(self, step: Step) -> torch.Tensor:
        return self.run_ops(step).buf["logits"]

    @torch.inference_mode()
    def decode(self, step: Step) -> torch.Tensor:
        return self.run_ops(step).buf["logits"]
