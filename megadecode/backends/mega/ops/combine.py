"""COMBINE: hidden[t, r] (+)= sum_a wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r]) for rows [r0, r1), t < B: the
weighted sum of the selected experts' outputs, as its own phase after EXPERT_DOWN's pair-major items (F_FRAG), whose
CTAs each hold some pairs' rows, not some rows of every pair"""

from __future__ import annotations

import torch

from ..isa import F_SHARED, F_STORE
from .opcode import Opcode

OP = Opcode("COMBINE", ("moe", "op_combine"))


def run(vm, ins, a) -> None:
    """COMBINE in pyvm (EXPERT_DOWN's weighted sum, `combine`)."""
    combine(vm, ins.flags, a)


def combine(vm, flags: int, a) -> None:
    """out[t, r0:r1] (+)= sum_a wts[t, a] * y[pairof[t, a], r0:r1] (+ shared[t, r0:r1]): EXPERT_DOWN's fused tail and
    COMBINE, in the slot order the kernel sums in."""
    D, r0, r1, B, A = (a[k] for k in ("D", "r0", "r1", "B", "A"))
    pairof = vm.ri(a["pairof_off"], B * A).tolist()
    wts = vm.rf(a["wts_off"], B * A)
    for t in range(B):
        out = torch.zeros(r1 - r0, device=wts.device) if flags & F_STORE else \
            vm.rf(a["out_off"] + t * D + r0, r1 - r0).clone()
        for k in range(A):
            out = out + wts[t * A + k] * vm.rf(a["y_off"] + pairof[t * A + k] * D + r0, r1 - r0)
        if flags & F_SHARED:
            out = out + vm.rf(a["shared_off"] + t * D + r0, r1 - r0)
        vm.wf(a["out_off"] + t * D + r0, out)
