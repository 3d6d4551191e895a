"""EXPERT_DOWN: for rows [r0, r1) of every selected expert: y[pair] = down[e] . h[pair]; then hidden[t, r] += sum_a
wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r])"""

from __future__ import annotations

import torch

from ..isa import F_FRAG, F_SHARED, F_STORE
from ..limits import BODY_I, KernelLimit
from .expert_up import check_frag
from .opcode import Opcode

OP = Opcode("EXPERT_DOWN", ("moe", "op_expert_down"), dtypes={"dn": torch.bfloat16}, mxfp4=("dn", "dns"),
            lengths={"I": 8}, aligned=("h_off", "I"))


def check(prog, ins, where: str) -> None:
    a = ins.args
    if a["B"] * a["A"] > BODY_I:
        # (its pair -> expert table, one shared int word per (token, slot) pair: MXFP4 always, bf16 when every
        # selected expert holds one pair)
        raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (EXPERT_DOWN's pair table takes "
                          f"one of the {BODY_I} shared int words below the instruction rows each)")
    if ins.flags & F_FRAG:
        check_frag(prog, ins, where)


def run(vm, ins, a) -> None:
    """EXPERT_DOWN in pyvm."""
    I, D, r0, r1, B, A = (a[k] for k in ("I", "D", "r0", "r1", "B", "A"))
    n, uniq, pstart = vm.groups(a)
    for u in range(n):
        Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)  # [rows, I]
        for p in range(pstart[u], pstart[u + 1]):
            vm.wf(a["y_off"] + p * D + r0, Wd @ vm.rf(a["h_off"] + p * I, I))
    pairof = vm.ri(a["pairof_off"], B * A).tolist()
    wts = vm.rf(a["wts_off"], B * A)
    for t in range(B):
        out = torch.zeros(r1 - r0, device=wts.device) if ins.flags & F_STORE else \
            vm.rf(a["out_off"] + t * D + r0, r1 - r0).clone()
        for k in range(A):
            out = out + wts[t * A + k] * vm.rf(a["y_off"] + pairof[t * A + k] * D + r0, r1 - r0)
        if ins.flags & F_SHARED:
            out = out + vm.rf(a["shared_off"] + t * D + r0, r1 - r0)
        vm.wf(a["out_off"] + t * D + r0, out)
