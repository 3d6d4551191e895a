"""A lowered decode step: instructions, the tensor table, the arenas and the counters.

`Program` is what `lower.lower()` builds from a decode plan for one batch size, what `schedule.schedule()` assigns
to the CTAs, what `pyvm` interprets on the CPU and what the CuTe kernel walks on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .isa import F_STAGE, F_TC, ROW, W_NEXT, W_STAGE, Instr
from .limits import RING_PAGE, RING_SLOTS, SMEM_F


@dataclass
class Tensor:
    """One entry of the tensor table: a weight (static for the whole launch) or a cache part (produced)."""
    name: str
    tensor: torch.Tensor
    role: str  # "static" | "produced"


@dataclass
class Program:
    cfg: object  # ModelConfig
    batch: int
    instrs: list[Instr]
    tensors: list[Tensor]
    f32: dict[str, tuple[int, int]]  # fp32 arena: buffer -> (offset, size) in elements
    i32: dict[str, tuple[int, int]]  # int32 arena
    counters: int  # counters used (counter 0 holds the launch number)
    phases: list[str] = field(default_factory=list)  # counter c (>= 1) is signalled by phase c - 1
    # filled by schedule.schedule()
    num_ctas: int = 0
    queues: list[list[int]] = field(default_factory=list)  # per CTA: instruction indices, in order
    predicted_us: list[float] = field(default_factory=list)  # per instruction: estimated finish time

    @property
    def f32_size(self) -> int:
        return max((o + n for o, n in self.f32.values()), default=0)

    @property
    def i32_size(self) -> int:
        return max((o + n for o, n in self.i32.values()), default=0)

    def to(self, device) -> "Program":
        """A copy whose tensor table lives on `device` (weights and caches copied): pyvm on the CPU for a program
        built on the GPU."""
        from dataclasses import replace

        return replace(self, tensors=[Tensor(t.name, t.tensor.to(device), t.role) for t in self.tensors])

    def tensor_index(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(name)

    def stageable(self, ins: Instr) -> bool:
        """Whether the kernel's ring build streams this instruction's weights through its CTA's ring (F_STAGE): a
        batch-1 MATVEC on the CUDA cores, of bf16 rows whose static bytes (words 10..12) are exactly rows [r0, r1),
        a pair of rows within half the ring less a page (a round of the staged body, `cute/dense.py`, then fits while
        the next one streams), its input row within the working shared memory (K fp32 below the rstd words).
        The routed experts' rows are not staged: measured, their loader could start an item's pages only once its
        body had routed, and the staged item took longer than one reading its rows from global memory
        (docs/megakernel.md, "The weight ring at batch 1")."""
        a = ins.args
        t, off, n = ins.prefetch
        return (RING_SLOTS > 0 and ins.op == "MATVEC" and a["B"] == 1 and not ins.flags & F_TC and t >= 0
                and self.tensors[t].tensor.dtype == torch.bfloat16 and off == 2 * a["r0"] * a["K"]
                and n == 2 * (a["r1"] - a["r0"]) * a["K"] and 4 * a["K"] <= (RING_SLOTS // 2 - 1) * RING_PAGE
                and a["K"] <= SMEM_F - 128)

    def ring_rounds(self, ins: Instr) -> list[tuple[int, int]]:
        """A staged MATVEC's rounds as the kernel's staged body cuts them (cute/dense.py staged_rows): per round the
        first and last page (of the instruction's own, from 0) its row pairs read. Up to NW pairs a round, the
        round's first page the one holding its first pair, its pairs ending within half the ring from that page."""
        from .limits import NT

        nw, half = NT // 32, RING_SLOTS // 2
        out = []
        a = ins.args
        K, nrows = a["K"], a["r1"] - a["r0"]
        npairs, pb, total = (nrows + 1) // 2, 4 * K, 2 * nrows * K
        q0 = 0
        while q0 < npairs:
            pa = q0 * pb // RING_PAGE
            q1 = min(q0 + nw, npairs, max(q0 + 1, (pa + half) * RING_PAGE // pb))
            out.append((pa, (min(q1 * pb, total) - 1) // RING_PAGE))
            q0 = q1
        return out

    def rows(self, ring: bool = False) -> torch.Tensor:
        """[N, ROW] int32: every instruction serialized, word W_NEXT the next instruction of its CTA's queue (-1
        for the last of a queue, and for every instruction of a program not scheduled yet); for the kernel's ring
        build (`ring`), the stageable ones flagged F_STAGE, word W_STAGE the next flagged instruction of the same
        queue (-1: none)."""
        rows = torch.tensor([i.row() for i in self.instrs], dtype=torch.int32).reshape(-1, ROW)
        rows[:, W_NEXT] = -1
        rows[:, W_STAGE] = -1
        for q in self.queues:
            if len(q) > 1:
                rows[q[:-1], W_NEXT] = torch.tensor(q[1:], dtype=torch.int32)
            nxt = -1
            for i in reversed(q):
                rows[i, W_STAGE] = nxt
                if ring and self.stageable(self.instrs[i]):
                    rows[i, 3] |= F_STAGE
                    nxt = i
        return rows

    def queue_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts [num_ctas + 1], order [N]) int32: CTA c runs instructions order[starts[c]:starts[c + 1]]."""
        starts, order = [0], []
        for q in self.queues:
            order += q
            starts.append(len(order))
        return torch.tensor(starts, dtype=torch.int32), torch.tensor(order, dtype=torch.int32)

    def per_launch(self) -> list[int]:
        """How many instructions signal each counter per launch."""
        n = [0] * self.counters
        for ins in self.instrs:
            if ins.signal >= 0:
                n[ins.signal] += 1
        return n

    def check(self) -> None:
        """Structural checks: every wait names a counter some instruction signals, with the count that signals it
        per launch, and only counters of earlier phases (so in-order queues cannot deadlock)."""
        per = self.per_launch()
        for ins in self.instrs:
            for w in ins.waits:
                if not 1 <= w.counter < self.counters:
                    raise ValueError(f"{ins.name}: waits on counter {w.counter}, not in [1, {self.counters})")
                if w.per_launch != per[w.counter] or not 0 < w.need <= w.per_launch:
                    raise ValueError(f"{ins.name}: waits for {w.need}/{w.per_launch} on counter {w.counter}, "
                                     f"which {per[w.counter]} instructions signal")
                if ins.signal >= 0 and w.counter >= ins.signal:
                    raise ValueError(f"{ins.name}: waits on counter {w.counter}, not earlier than its own "
                                     f"signal {ins.signal}")

    def summary(self) -> str:
        from collections import Counter

        ops = Counter(i.op for i in self.instrs)
        mb = sum(i.bytes for i in self.instrs) / 1e6
        return (f"{self.cfg.family} batch {self.batch}: {len(self.instrs)} instructions "
                f"({', '.join(f'{n} {o}' for o, n in sorted(ops.items()))}), {self.counters - 1} phases, "
                f"{mb:.1f} MB estimated, arenas fp32 {self.f32_size} / int32 {self.i32_size} elements")
