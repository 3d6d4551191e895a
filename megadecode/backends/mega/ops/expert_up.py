"""EXPERT_UP: h[pair, i] = glu(gate_up[e] . x_t) for the units [w * N / W, (w + 1) * N / W) of N = pre[nuniq] * I:
unit pre[u] * I + q * I + r is row r of expert u against its pairs [q * P, (q + 1) * P) (`up_chunks`), P and the
pass prefix `pre` by `up_passes`: bf16 qst (PASS pairs a pass), MXFP4 pstart (one pair a pass)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....quant.mxfp4_frag import KREC, RECORD
from ....reference.activations import situ_glu
from ..isa import (FRAG_DOWN, FRAG_TILE, F_FRAG, F_GROUP, F_MXFP4, F_PAIR1, F_RENORM, F_ROUTE, F_SITU, GROUP_MAX_E,
                   GROUP_N, GROUP_TILE, TC_K, group_prefix, tc_input, up_chunks, up_passes)
from ..limits import BODY_I, NT, SMEM_F, KernelLimit
from . import route
from .opcode import Opcode

OP = Opcode("EXPERT_UP", ("moe", "op_expert_up"), dtypes={"gu": torch.bfloat16}, mxfp4=("gu", "gus"), lengths={"D": 8},
            aligned=("x_off", "D"))


def check(prog, ins, where: str) -> None:
    if ins.flags & F_FRAG:
        check_frag(prog, ins, where)
    if ins.flags & F_ROUTE:
        check_route(ins, where)
    if ins.flags & F_GROUP:
        check_group(ins, where)


# F_GROUP's shared int words (cute/moe.py group_tables): the pass prefix, pstart and the experts, then the scan's
# scratch
GROUP_WORDS = 3 * (GROUP_MAX_E + 1) + NT // 32


def check_group(ins, where: str) -> None:
    """F_GROUP (the grouped tensor-core expert bodies, cute/moe.py): bf16 experts whose dims are whole 16-row
    tiles and whole tensor-core steps, at most GROUP_MAX_E of them (their tables in shared memory), pass-wise: not
    with F_PAIR1, F_ROUTE, F_MXFP4 or F_FRAG."""
    a = ins.args
    if ins.flags & (F_MXFP4 | F_FRAG | F_PAIR1 | F_ROUTE):
        raise KernelLimit(f"{where}: F_GROUP takes bf16 experts in passes of {GROUP_N} pairs, not with F_MXFP4, "
                          f"F_FRAG, F_PAIR1 or F_ROUTE")
    I, D, E = a["I"], a["D"], a.get("E", 0)
    if I % GROUP_TILE or D % GROUP_TILE or I % TC_K or D % TC_K:
        raise KernelLimit(f"{where}: F_GROUP needs I and D multiples of {GROUP_TILE} and {TC_K}, got I = {I}, "
                          f"D = {D}")
    if E > GROUP_MAX_E:
        raise KernelLimit(f"{where}: F_GROUP holds its experts' tables in shared memory: at most {GROUP_MAX_E} "
                          f"experts, got {E}")
    assert GROUP_WORDS <= BODY_I


def check_route(ins, where: str) -> None:
    """F_ROUTE (the routing inside EXPERT_UP, cute/moe.py route_one): one token's softmax picks by rank, a thread an
    expert and a lane a pick, for bf16 experts one pair a pass."""
    a = ins.args
    if ins.flags & (F_MXFP4 | F_FRAG) or not ins.flags & F_PAIR1:
        raise KernelLimit(f"{where}: F_ROUTE takes bf16 experts one pair a pass (F_PAIR1), not MXFP4 or F_FRAG")
    if not 1 <= a["A"] <= min(32, a["E"]) or a["E"] > NT:
        raise KernelLimit(f"{where}: F_ROUTE picks by rank with a thread an expert and a lane a pick: at most {NT} "
                          f"experts and 32 picks, got E = {a['E']}, A = {a['A']}")


def check_frag(prog, ins, where: str) -> None:
    """F_FRAG (the tensor-core expert bodies, cute/moe.py): MXFP4 records of quant/mxfp4_frag.py's shape for the
    instruction's dims, reductions whole records (256), EXPERT_UP's gate / up split on a tile boundary and
    EXPERT_DOWN's rows whole units of FRAG_DOWN, and the staged row (each item stages its pairs' rows of the
    reduction width K, as two fp16 planes and 8 words) within shared memory. EXPERT_UP's pair table shares
    EXPERT_DOWN's bound (one shared int word a pair, checked on the layer's EXPERT_DOWN). F_FRAG without F_MXFP4 is
    refused by the dtype check (records are uint8, bf16 experts are not)."""
    a = ins.args
    up = ins.op == "EXPERT_UP"
    I, D = a["I"], a["D"]
    R, K = (2 * I, D) if up else (D, I)
    w = prog.tensors[a["gu" if up else "dn"]].tensor
    if K + 8 > SMEM_F:
        raise KernelLimit(f"{where}: reduction width {K} ({ins.op} stages a pair's row as two fp16 planes and 8 words "
                          f"in {SMEM_F} shared fp32 words: at most {SMEM_F - 8})")
    if K % KREC or I % FRAG_TILE or tuple(w.shape[1:]) != (R // FRAG_TILE, K // KREC, RECORD):
        raise KernelLimit(f"{where}: fragment-order experts need records [E, {R}/{FRAG_TILE}, {K}/{KREC}, {RECORD}] "
                          f"(K a multiple of {KREC}, I of {FRAG_TILE}); got {tuple(w.shape)} for I = {I}, D = {D}")
    if not up and D % FRAG_DOWN:
        raise KernelLimit(f"{where}: output width {D} is not a whole number of {FRAG_DOWN}-row units")


def run(vm, ins, a) -> None:
    """EXPERT_UP in pyvm."""
    I, D = a["I"], a["D"]
    P, pre_arg = up_passes(ins.flags)  # pairs per pass and the pass prefix (MXFP4: one pair a pass)
    if ins.flags & F_ROUTE:  # the item's own routing of the one token (ROUTE's); item 0 also writes ROUTE's outputs
        r = route.routing(vm, ins.flags & F_RENORM, a)
        if a["w"] == 0:
            route.write(vm, a, r)
        n, uniq, pstart, pre, ptok = r["nuniq"], r["uniq"], r["pstart"], r["pstart"], r["ptok"]
    else:
        n, uniq, pstart = vm.groups(a)
        pre = vm.ri(a[pre_arg], n + 1).tolist()
        ptok = None
    if ins.flags & F_GROUP:  # passes of GROUP_N pairs, shares of whole 16-row tiles, the input as tc_input
        P, pre = GROUP_N, group_prefix(pstart)
    unit = FRAG_TILE if ins.flags & F_FRAG else GROUP_TILE if ins.flags & F_GROUP else 1
    for u, q, r0, r1 in up_chunks(pre, I, a["w"], a["W"], unit):
        p0 = pstart[u] + q * P
        pairs = range(p0, min(pstart[u + 1], p0 + P))
        toks = ptok[p0:p0 + len(pairs)] if ptok is not None else vm.ri(a["ptok_off"] + p0, len(pairs)).tolist()
        x = torch.stack([vm.rf(a["x_off"] + t * D, D) for t in toks])
        if ins.flags & F_GROUP:
            x = tc_input(x)
        g = x @ vm.rows_of(ins, a["gu"], a["gus"], uniq[u], r0, r1).T
        up = x @ vm.rows_of(ins, a["gu"], a["gus"], uniq[u], I + r0, I + r1).T
        hv = situ_glu(g, up) if ins.flags & F_SITU else F.silu(g) * up
        for j, p in enumerate(pairs):
            vm.wf(a["h_off"] + p * I + r0, hv[j])
