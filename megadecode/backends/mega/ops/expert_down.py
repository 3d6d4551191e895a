"""EXPERT_DOWN: for rows [r0, r1) of every selected expert: y[pair] = down[e] . h[pair]; then hidden[t, r] += sum_a
wts[t, a] * y[pair_of(t, a), r] (+ shared[t, r]). F_FRAG: y alone, pair-major units of FRAG_DOWN rows (the weighted
sum is the next phase's COMBINE); F_GROUP: y alone, pair-major units of a pass (GROUP_N pairs of one expert) and
GROUP_TILE rows, the input as tc_input (COMBINE after it too)"""

from __future__ import annotations

import torch

from ..isa import FRAG_DOWN, F_FRAG, F_GROUP, GROUP_N, GROUP_TILE, group_prefix, tc_input, up_chunks
from ..limits import BODY_I, KernelLimit
from .combine import combine
from .expert_up import check_frag, check_group
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
    if ins.flags & F_GROUP:
        check_group(ins, where)


def run(vm, ins, a) -> None:
    """EXPERT_DOWN in pyvm."""
    I, D = a["I"], a["D"]
    n, uniq, pstart = vm.groups(a)
    if ins.flags & F_FRAG:  # pair-major units (pair, FRAG_DOWN rows), one pair a pass
        for u, q, r0, r1 in up_chunks(pstart, D, a["w"], a["W"], FRAG_DOWN):
            p = pstart[u] + q
            Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)
            vm.wf(a["y_off"] + p * D + r0, Wd @ vm.rf(a["h_off"] + p * I, I))
        return
    if ins.flags & F_GROUP:  # pair-major units (pass, GROUP_TILE rows), GROUP_N pairs a pass
        for u, q, r0, r1 in up_chunks(group_prefix(pstart), D, a["w"], a["W"], GROUP_TILE):
            p0 = pstart[u] + q * GROUP_N
            p1 = min(pstart[u + 1], p0 + GROUP_N)
            Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)
            h = tc_input(torch.stack([vm.rf(a["h_off"] + p * I, I) for p in range(p0, p1)]))
            y = h @ Wd.T
            for j, p in enumerate(range(p0, p1)):
                vm.wf(a["y_off"] + p * D + r0, y[j])
        return
    r0, r1 = a["r0"], a["r1"]
    for u in range(n):
        Wd = vm.rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)  # [rows, I]
        for p in range(pstart[u], pstart[u + 1]):
            vm.wf(a["y_off"] + p * D + r0, Wd @ vm.rf(a["h_off"] + p * I, I))
    combine(vm, ins.flags, a)
