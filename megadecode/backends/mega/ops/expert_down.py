"""EXPERT_DOWN: for rows [r0, r1) of every selected expert: y[pair] = down[e] . h[pair]; then hidden[t, r] += sum_a
wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r]). F_FRAG (F_PAIR1): y alone, pair-major units of FRAG_DOWN (DOWN_PAIR)
rows (the weighted sum is the next phase's COMBINE)"""

from __future__ import annotations

import torch

from ..isa import F_FRAG, F_MXFP4, F_PAIR1, down_unit, up_chunks
from ..limits import BODY_I, KernelLimit
from .combine import combine
from .expert_up import check_frag
from .opcode import Opcode

OP = Opcode("EXPERT_DOWN", ("moe", "op_expert_down"), dtypes={"dn": torch.bfloat16}, mxfp4=("dn", "dns"),
            lengths={"I": 8}, aligned=("h_off", "I"))


def check(prog, ins, where: str) -> None:
    a = ins.args
    if a["B"] * a["A"] > BODY_I:
        # (its pair -> expert table, one shared int word per (token, slot) pair: MXFP4 and F_PAIR1 always, other
        # bf16 items when the selected experts hold at most 2 pairs each on average)
        raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (EXPERT_DOWN's pair table takes "
                          f"one of the {BODY_I} shared int words below the instruction rows each)")
    if ins.flags & F_FRAG:
        check_frag(prog, ins, where)
    if ins.flags & F_PAIR1:
        if ins.flags & (F_MXFP4 | F_FRAG):
            raise KernelLimit(f"{where}: F_PAIR1 (pair-major units of bf16 rows) with MXFP4 experts")
        if a["D"] % down_unit(ins.flags) or (a["r0"], a["r1"]) != (0, a["D"]):
            raise KernelLimit(f"{where}: pair-major items take whole {down_unit(ins.flags)}-row units of all "
                              f"{a['D']} rows (rows [{a['r0']}, {a['r1']}))")


def run(vm, ins, a) -> None:
    """EXPERT_DOWN in pyvm."""
    I, D = a["I"], a["D"]
    n, uniq, pstart = vm.groups(a)
    unit = down_unit(ins.flags)
    if unit:  # pair-major units (pair, `unit` rows), one pair a pass
        for u, q, r0, r1 in up_chunks(pstart, D, a["w"], a["W"], unit):
            p = pstart[u] + q
            Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)
            vm.wf(a["y_off"] + p * D + r0, Wd @ vm.rf(a["h_off"] + p * I, I))
        return
    r0, r1 = a["r0"], a["r1"]
    for u in range(n):
        Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)  # [rows, I]
        for p in range(pstart[u], pstart[u + 1]):
            vm.wf(a["y_off"] + p * D + r0, Wd @ vm.rf(a["h_off"] + p * I, I))
    combine(vm, ins.flags, a)
