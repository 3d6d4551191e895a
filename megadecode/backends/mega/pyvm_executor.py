"""The `pyvm` executor: decode steps run as the megakernel's instruction stream, interpreted with torch
(megadecode/backends/mega/pyvm.py), one program per batch size; prefill runs the torch reference. It is the golden model
of the `mega` executor on any device (slow: one Python call per instruction), and the CPU test of the lowering
and the schedule: every wait is asserted when its instruction runs, and `check_races=True` also checks after
each step that no two unordered instructions touched the same element.
"""

from __future__ import annotations

import torch

from ...cache import KVCache
from ...plan import DecodePlan
from ...step import Step
from ..base import ExecutorBase
from ..torch.executor import TorchExecutor

PYVM_CTAS = 8  # CTAs the schedule assumes for pyvm (any number is valid; small keeps the step fast)


def refuse_parallel(name: str, parallel) -> None:
    """The instruction stream (pyvm, mega) has no collective: expert parallelism is refused, saying why."""
    if parallel is not None and parallel.world > 1:
        raise ValueError(f"the {name} executor runs one process's whole model as one instruction stream, which has "
                         f"no collective to combine the ranks' experts: expert parallelism (--ep > 1) runs the "
                         f"torch, graph or fused executors")


def stream_supports(cls, cfg) -> str | None:
    """An instruction-stream executor's (pyvm, mega) `supports`: the family registry's word, then what the lowering
    takes (lower.supports: MLA with rope, LatentMoE, 16-bit experts, the expert count ROUTE holds)."""
    from .lower import supports

    why = ExecutorBase.supports.__func__(cls, cfg) or supports(cfg, 1)
    return why and f"the {cls.name} executor cannot run {cfg.family}: {why}"


class PyVMExecutor(TorchExecutor):
    name = "pyvm"
    supports = classmethod(stream_supports)

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache, *,
                 num_ctas: int = PYVM_CTAS, order: str = "round_robin", check_races: bool = False, parallel=None):
        from .lower import check_plan

        refuse_parallel(self.name, parallel)
        check_plan(plan, plan.config)
        super().__init__(plan, weights, cache)
        self.num_ctas, self.order, self.check_races = num_ctas, order, check_races
        self.vms: dict[tuple, object] = {}  # (batch, causal_rows)
        self.steps = 0

    def vm(self, batch: int, causal_rows: bool = False):
        from .lower import lower
        from .pyvm import PyVM
        from .schedule import schedule

        key = (batch, causal_rows)
        if key not in self.vms:
            prog = lower(self.cfg, self.weights, self.cache, batch, self.num_ctas, causal_rows=causal_rows)
            self.vms[key] = PyVM(schedule(prog, self.num_ctas))
        return self.vms[key]

    @torch.inference_mode()
    def decode(self, step: Step) -> torch.Tensor:
        vm = self.vm(step.num_tokens, step.causal_rows)
        load_step(vm, step)
        vm.accesses.clear()
        vm.launch(self.order, seed=self.steps)
        self.steps += 1
        if self.check_races:
            found = vm.races()
            if found:
                raise RuntimeError("pyvm found unordered accesses:\n" + "\n".join(found))
        logits = read_logits(vm, step.num_tokens)
        self.flag_nonfinite(logits, step)
        return logits


def load_step(vm, step: Step) -> None:
    """The step inputs into the int32 arena (what the host writes before a launch)."""
    i32 = vm.prog.i32
    for name, t in (("tokens", step.tokens), ("positions", step.positions), ("slots", step.slots)):
        off, n = i32[name]
        vm.i32[off:off + n] = t.to(device=vm.i32.device, dtype=torch.int32)


def read_logits(vm, batch: int) -> torch.Tensor:
    off, n = vm.prog.f32["logits"]
    return vm.f32[off:off + n].view(batch, -1).clone()
