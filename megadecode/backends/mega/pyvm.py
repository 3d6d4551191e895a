"""pyvm: the megakernel's golden model. It interprets the same instruction rows on the CPU (or any torch device)
with plain torch, one instruction at a time, in an order the CTAs' queues allow:

- each CTA walks its queue in order; at every step one CTA whose next instruction's waits are satisfied runs it
  (round robin, or a seeded random pick to try other interleavings); if no CTA can move, the schedule deadlocks
  and pyvm raises naming the blocked instructions;
- every wait is asserted satisfied when its instruction runs (the launch number's target, wrapping int32);
- every arena element and cache row an instruction reads or writes is recorded, and `races()` checks that any two
  instructions touching the same element, one of them writing, are ordered by their counters (a wait on every
  producer of a phase orders that phase before the waiter, transitively).

The semantics of each opcode here is the specification the CuTe kernel implements (fp32 activations, weights and
caches in their dtype; keys and latents read back rounded to the cache dtype).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from . import ops
from .isa import Instr
from .program import Program
from .pyvm_ops import VMOps


class DeadlockError(RuntimeError):
    pass


class WaitViolation(RuntimeError):
    pass


@dataclass
class Access:
    space: str  # "f32" | "i32" | "t<index>" (a cache tensor, flat element range)
    lo: int
    hi: int
    write: bool
    instr: int


def _wrap(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31



class PyVM(VMOps):
    def __init__(self, prog: Program, device=None):
        self.prog = prog
        dev = device or prog.tensors[0].tensor.device
        self.f32 = torch.zeros(prog.f32_size, dtype=torch.float32, device=dev)
        self.i32 = torch.zeros(prog.i32_size, dtype=torch.int32, device=dev)
        self.counters = [0] * prog.counters  # counters[0]: the launch number
        self.T = [t.tensor for t in prog.tensors]
        self.accesses: list[Access] = []
        self.trace: list[int] = []
        self._cur = -1

    # ---- memory, with the accesses recorded --------------------------------------------------------
    def _rec(self, space, lo, hi, write):
        if hi > lo:
            self.accesses.append(Access(space, int(lo), int(hi), write, self._cur))

    def rf(self, off: int, n: int) -> torch.Tensor:
        self._rec("f32", off, off + n, False)
        return self.f32[off:off + n]

    def wf(self, off: int, val: torch.Tensor) -> None:
        val = val.reshape(-1)
        self._rec("f32", off, off + val.numel(), True)
        self.f32[off:off + val.numel()] = val.float()

    def ri(self, off: int, n: int) -> torch.Tensor:
        self._rec("i32", off, off + n, False)
        return self.i32[off:off + n]

    def wi(self, off: int, val) -> None:
        val = torch.as_tensor(val, dtype=torch.int32, device=self.i32.device).reshape(-1)
        self._rec("i32", off, off + val.numel(), True)
        self.i32[off:off + val.numel()] = val

    def cache_row(self, t: int, index: tuple, write: torch.Tensor | None = None) -> torch.Tensor:
        """Read (or write) one row tensor[index] of a cache tensor, recorded as a flat element range."""
        ten = self.T[t]
        row = ten[index]
        lo = sum(i * s for i, s in zip(index, ten.stride()))
        self._rec(f"t{t}", lo, lo + row.numel(), write is not None)
        if write is not None:
            ten[index] = write.to(ten.dtype)
            return ten[index]
        return row

    # ---- running ------------------------------------------------------------------------------------
    def launch(self, order: str = "round_robin", seed: int = 0) -> None:
        """One launch: every CTA's queue run to its end, in an interleaving `order` allows."""
        prog = self.prog
        if not prog.queues:
            raise ValueError("the program is not scheduled (mega.schedule.schedule)")
        self.counters[0] += 1
        epoch = self.counters[0]
        heads = [0] * len(prog.queues)
        rng = random.Random(seed)
        left = sum(len(q) for q in prog.queues)
        rr = 0
        while left:
            ready = [c for c, q in enumerate(prog.queues)
                     if heads[c] < len(q) and self._ready(prog.instrs[q[heads[c]]], epoch)]
            if not ready:
                blocked = [prog.instrs[q[heads[c]]].name for c, q in enumerate(prog.queues) if heads[c] < len(q)]
                raise DeadlockError(f"no CTA can proceed; blocked: {blocked[:8]}")
            if order == "random":
                c = rng.choice(ready)
            else:
                later = [x for x in ready if x >= rr]
                c = later[0] if later else ready[0]
                rr = c + 1
            idx = prog.queues[c][heads[c]]
            heads[c] += 1
            left -= 1
            self.execute(idx, epoch)

    def _ready(self, ins: Instr, epoch: int) -> bool:
        return all(_wrap(self.counters[w.counter] - ((epoch - 1) * w.per_launch + w.need)) >= 0 for w in ins.waits)

    def execute(self, idx: int, epoch: int) -> None:
        ins = self.prog.instrs[idx]
        if not self._ready(ins, epoch):
            raise WaitViolation(f"{ins.name} ran before its waits were satisfied")
        self._cur = idx
        self.trace.append(idx)
        if ins.op != "NOP":
            ops.BY_NAME[ins.op].run(self, ins, ins.args)  # the opcode's module (ops/)
        if ins.signal >= 0:
            self.counters[ins.signal] = _wrap(self.counters[ins.signal] + 1)

    # ---- race check ---------------------------------------------------------------------------------
    def ancestors(self) -> dict[int, set[int]]:
        """counter -> the counters it transitively waits on (a full wait orders every producer before)."""
        direct: dict[int, set[int]] = {}
        for ins in self.prog.instrs:
            s = direct.setdefault(ins.signal, set())
            s.update(w.counter for w in ins.waits if w.need == w.per_launch)
        out: dict[int, set[int]] = {}
        for c in sorted(direct):
            acc = set()
            for d in direct[c]:
                acc |= {d} | out.get(d, set())
            out[c] = acc
        return out

    def races(self, limit: int = 10) -> list[str]:
        """Pairs of instructions that touch the same element, one writing, with no counter ordering them. Order is
        a property of phases (the counters instructions signal): accesses of one phase are checked against each
        other and against the phases neither before nor after it."""
        anc = self.ancestors()
        instrs = self.prog.instrs
        phase_of = lambda a: instrs[a.instr].signal
        by_phase: dict[int, list[Access]] = {}
        for a in self.accesses:
            by_phase.setdefault(phase_of(a), []).append(a)
        phases = sorted(by_phase)
        groups = [[p] for p in phases]  # a phase against itself
        groups += [[p, q] for i, p in enumerate(phases) for q in phases[i + 1:]
                   if p not in anc.get(q, ()) and q not in anc.get(p, ())]
        found: list[str] = []
        for group in groups:
            accs = sorted((a for p in group for a in by_phase[p]), key=lambda a: (a.space, a.lo))
            active: list[Access] = []
            for a in accs:
                active = [b for b in active if b.space == a.space and b.hi > a.lo]
                for b in active:
                    if (a.write or b.write) and a.instr != b.instr and (len(group) == 1 or
                                                                        phase_of(a) != phase_of(b)):
                        found.append(f"{a.space}[{max(a.lo, b.lo)}:{min(a.hi, b.hi)}]: {instrs[b.instr].name} "
                                     f"({'write' if b.write else 'read'}) and {instrs[a.instr].name} "
                                     f"({'write' if a.write else 'read'}) are not ordered")
                        if len(found) >= limit:
                            return found
                active.append(a)
        return found
