"""The `torch` executor: every plan op in plain PyTorch, in order. The reference and HF-parity path."""

from __future__ import annotations

import torch

from ...cache import KVCache
from ...plan import DecodePlan, final_norm_input
from ...step import Step
from .. import expert_layout
from ..base import ExecutorBase
from .ops import OP_IMPLS, StepContext


class TorchExecutor(ExecutorBase):
    name = "torch"
    experts_impl = "reference"

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *, parallel=None):
        """`parallel`: expert parallelism (megadecode.parallel.combine.ExpertParallel; the weights then hold this
        rank's experts), None in one process."""
        self.plan, self.cfg, self.cache = plan, plan.config, cache
        # this executor's own dict, the routed MXFP4 experts in the order it reads (backends/expert_layout.py)
        self.weights = expert_layout.take(weights, plan, self._expert_order(plan, weights))
        self.parallel = parallel
        # Per logits row (= cache slot): the cache position whose logits first held NaN or inf, -1 while none
        # has. Written on the device by every prefill and decode step (flag_nonfinite); the caller resets it
        # (fill_(-1)) and reads it once at the end (Engine.generate).
        dev = next(iter(weights.values())).device
        self.first_nonfinite = torch.full((cache.num_slots,), -1, dtype=torch.int64, device=dev)

    def _expert_order(self, plan: DecodePlan, weights: dict[str, torch.Tensor]) -> str:
        """The order this executor reads K3's routed experts in (backends/expert_layout.py): the checkpoint's."""
        return expert_layout.CHECKPOINT

    def flag_nonfinite(self, logits: torch.Tensor, step: Step) -> None:
        """Record, for each row of `logits` whose values are not all finite, the position of its token unless an
        earlier one is recorded. Device ops only (no host sync), so it runs inside a captured decode step."""
        n = min(logits.shape[0], self.first_nonfinite.shape[0])  # a verify step's rows may outnumber the slots
        seen = self.first_nonfinite[:n]
        bad = ~torch.isfinite(logits[:n]).all(-1)
        seen.copy_(torch.where(bad & (seen < 0), step.positions[step.logit_rows[:n]], seen))

    def graph_lengths(self, batch: int, kv_lo: int, kv_hi: int) -> list[int]:
        """The kv_len values, one per captured graph, that decode steps of `batch` sequences with kv_len in
        [kv_lo, kv_hi] replay (Engine.warmup captures them before serving): none, this executor runs eagerly."""
        return []

    def run_ops(self, step: Step, hook=None) -> StepContext:
        """Run the plan; `hook(op, ctx)` is called after each op (the harness diffs buffers there)."""
        ctx = StepContext(self.cfg, self.weights, self.cache, step, self.experts_impl, self.parallel)
        for op in self.plan.ops:
            OP_IMPLS[op.kind](ctx, op)
            if hook is not None:
                hook(op, ctx)
        return ctx

    @torch.inference_mode()
    def prefill(self, step: Step) -> torch.Tensor:
        ctx = self.run_ops(step)
        logits = ctx.buf["logits"]
        self.flag_nonfinite(logits, step)
        if step.last_hidden is not None:
            step.last_hidden.append(ctx.buf[final_norm_input(self.plan)])
        return logits

    @torch.inference_mode()
    def decode(self, step: Step) -> torch.Tensor:
        logits = self.run_ops(step).buf["logits"]
        self.flag_nonfinite(logits, step)
        return logits
