"""EXPERT_UP: h[pair, i] = glu(gate_up[e] . x_t) for the units [w * N / W, (w + 1) * N / W) of N = pre[nuniq] * I:
unit pre[u] * I + q * I + r is row r of expert u against its pairs [q * P, (q + 1) * P) (`up_chunks`), P and the
pass prefix `pre` by `up_passes`: bf16 qst (PASS pairs a pass), MXFP4 pstart (one pair a pass)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....quant.mxfp4_frag import KREC, RECORD
from ....reference.activations import situ_glu
from ..isa import FRAG_DOWN, FRAG_TILE, F_FRAG, F_SITU, up_chunks, up_passes
from ..limits import SMEM_F, KernelLimit
from .opcode import Opcode

OP = Opcode("EXPERT_UP", ("moe", "op_expert_up"), dtypes={"gu": torch.bfloat16}, mxfp4=("gu", "gus"), lengths={"D": 8},
            aligned=("x_off", "D"))


def check(prog, ins, where: str) -> None:
    if ins.flags & F_FRAG:
        check_frag(prog, ins, where)


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
    n, uniq, pstart = vm.groups(a)
    P, pre_arg = up_passes(ins.flags)  # pairs per pass and the pass prefix (MXFP4: one pair a pass)
    pre = vm.ri(a[pre_arg], n + 1).tolist()
    unit = FRAG_TILE if ins.flags & F_FRAG else 1  # F_FRAG: shares of whole 16-row tiles
    for u, q, r0, r1 in up_chunks(pre, I, a["w"], a["W"], unit):
        p0 = pstart[u] + q * P
        pairs = range(p0, min(pstart[u + 1], p0 + P))
        toks = vm.ri(a["ptok_off"] + p0, len(pairs)).tolist()
        x = torch.stack([vm.rf(a["x_off"] + t * D, D) for t in toks])
        g = x @ vm.rows_of(ins, a["gu"], a["gus"], uniq[u], r0, r1).T
        up = x @ vm.rows_of(ins, a["gu"], a["gus"], uniq[u], I + r0, I + r1).T
        hv = situ_glu(g, up) if ins.flags & F_SITU else F.silu(g) * up
        for j, p in enumerate(pairs):
            vm.wf(a["h_off"] + p * I + r0, hv[j])
