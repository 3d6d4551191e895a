"""The host scheduler: assign instructions to CTAs by a cost model, balancing each CTA's predicted time.

Cost of an instruction on one CTA: a fixed overhead (the wait, the block-wide syncs and the signal) plus the
larger of its bytes over one CTA's share of the HBM bandwidth and its flops over one CTA's share of the fp32 FMA
rate. List scheduling in the program's phase order: each instruction goes to the CTA where it would finish
first, starting no earlier than the predicted finish of every producer it waits on. Queues keep that order, so
every wait points to an earlier phase and in-order queues cannot deadlock while all CTAs are resident.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from ...hardware import HBM_READ_BPS
from .isa import F_NORM
from .program import Program

FP32_FLOPS = 60e12  # H200 fp32 FMA rate, order of magnitude (2 x 16896 lanes x 1.98 GHz = 67 TFLOP/s peak)
OVERHEAD_US = 1.0  # per instruction: the wait, syncs and signal (GPU.md: a grid-wide barrier costs ~1 us)
# L2 to the SMs, for the activations an RMSNorm prologue re-reads: an assumed order of magnitude (not measured; the
# H200's HBM rate is 4.57 TB/s and L2 serves several times that). Without the term, K3's 1-row KDA projections
# (18 us each on the H200, predicted ~1 us) are stacked 15 to a CTA while the GPU waits.
L2_BPS = 8e12


@dataclass(frozen=True)
class CostModel:
    bytes_per_s: float = HBM_READ_BPS
    flops_per_s: float = FP32_FLOPS
    overhead_us: float = OVERHEAD_US

    norm_bytes_per_s: float = L2_BPS

    def us(self, ins, num_ctas: int) -> float:
        t_bytes = ins.bytes / (self.bytes_per_s / num_ctas) * 1e6
        t_flops = ins.flops / (self.flops_per_s / num_ctas) * 1e6
        t = self.overhead_us + max(t_bytes, t_flops)
        if ins.op in ("MATVEC", "GLU") and ins.flags & F_NORM:  # the RMSNorm prologue reads every token's row
            rows = ins.args["B"] * ins.args["K"] * 4 * (2 if ins.args.get("x2_off", -1) >= 0 else 1)
            t += self.overhead_us + rows / (self.norm_bytes_per_s / num_ctas) * 1e6
        return t


def schedule(prog: Program, num_ctas: int, cost: CostModel = CostModel()) -> Program:
    """Fill prog.queues (one list of instruction indices per CTA) and prog.predicted_us (finish times)."""
    if num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
    heap = [(0.0, c) for c in range(num_ctas)]  # (free at, CTA): the earliest free CTA starts soonest
    done_at: dict[int, float] = {}  # counter -> latest predicted finish of its producers so far
    queues: list[list[int]] = [[] for _ in range(num_ctas)]
    finish = [0.0] * len(prog.instrs)
    for idx, ins in enumerate(prog.instrs):
        ready = max((done_at.get(w.counter, 0.0) for w in ins.waits), default=0.0)
        free, c = heapq.heappop(heap)
        finish[idx] = max(free, ready) + cost.us(ins, num_ctas)
        heapq.heappush(heap, (finish[idx], c))
        queues[c].append(idx)
        if ins.signal >= 0:
            done_at[ins.signal] = max(done_at.get(ins.signal, 0.0), finish[idx])
    prog.num_ctas, prog.queues, prog.predicted_us = num_ctas, queues, finish
    return prog


def occupancy(nbytes: float, window_us: float) -> float:
    """The share of the HBM's read rate that moving `nbytes` in `window_us` takes (0 for an empty window)."""
    return nbytes / (window_us * 1e-6 * HBM_READ_BPS) if window_us > 0 else 0.0


def report(prog: Program, top: int = 12) -> str:
    """A readable account of a schedule: per phase its instructions, the most any one CTA runs (above one, the phase
    waits for a CTA's second instruction), bytes, predicted window and the HBM occupancy that window implies (its
    bytes over the window at the HBM's read rate: where a phase is latency, not bytes), the first and last `top`
    phases shown; per CTA the spread of busy time and of bytes streamed; the predicted step against the floor of
    its bytes."""
    if not prog.queues:
        return "not scheduled"
    cost = CostModel()
    lines = [prog.summary(), f"{prog.num_ctas} CTAs; predicted step {max(prog.predicted_us):.1f} us; "
             f"bytes floor {sum(i.bytes for i in prog.instrs) / HBM_READ_BPS * 1e6:.1f} us"]
    start = {}
    for idx, ins in enumerate(prog.instrs):
        s = prog.predicted_us[idx] - cost.us(ins, prog.num_ctas)
        start[idx] = s
    cta_of = {i: c for c, q in enumerate(prog.queues) for i in q}
    by_phase: dict[int, list[int]] = {}
    for idx, ins in enumerate(prog.instrs):
        by_phase.setdefault(ins.signal, []).append(idx)
    lines.append(f"{'phase':<16} {'instrs':>6} {'max/CTA':>7} {'MB':>8} {'start us':>9} {'end us':>9} {'HBM':>5}")
    phases = sorted(by_phase.items())
    for k, (c, idxs) in enumerate(phases):
        if top <= k < len(phases) - top:
            if k == top:
                lines.append(f"... {len(phases) - 2 * top} phases ...")
            continue
        name = prog.phases[c - 1] if 0 < c <= len(prog.phases) else str(c)
        nb = sum(prog.instrs[i].bytes for i in idxs)
        t0, t1 = min(start[i] for i in idxs), max(prog.predicted_us[i] for i in idxs)
        most = max(Counter(cta_of[i] for i in idxs).values())
        lines.append(f"{name:<16} {len(idxs):>6} {most:>7} {nb / 1e6:>8.2f} {t0:>9.1f} {t1:>9.1f} "
                     f"{occupancy(nb, t1 - t0):>5.0%}")
    busy = [sum(cost.us(prog.instrs[i], prog.num_ctas) for i in q) for q in prog.queues]
    lines.append(f"per-CTA busy us: min {min(busy):.1f} mean {sum(busy) / len(busy):.1f} max {max(busy):.1f}; "
                 f"queue lengths {min(map(len, prog.queues))}..{max(map(len, prog.queues))}")
    streamed = [sum(prog.instrs[i].bytes for i in q) / 1e6 for q in prog.queues]
    step = max(prog.predicted_us)
    lines.append(f"per-CTA MB streamed: min {min(streamed):.2f} mean {sum(streamed) / len(streamed):.2f} max "
                 f"{max(streamed):.2f}; the step's predicted HBM occupancy "
                 f"{occupancy(sum(i.bytes for i in prog.instrs), step):.0%}")
    return "\n".join(lines)
