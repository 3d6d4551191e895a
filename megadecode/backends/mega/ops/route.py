"""ROUTE: routing for the whole batch: picks, weights, and the pairs grouped by expert (see backends/mega/lower.py)
(also each expert's passes of PASS pairs, as a prefix: qst[u] = sum over u' < u of ceil(pairs(u') / PASS))"""

from __future__ import annotations

import torch

from ..isa import F_RENORM, F_SIGMOID, PASS, bits_f32
from ..limits import BODY_I, SMEM_F, KernelLimit
from .opcode import Opcode

OP = Opcode("ROUTE", ("moe", "op_route"), dtypes={"bias_w": torch.float32})


def check(prog, ins, where: str) -> None:
    a = ins.args
    if 2 * a["E"] + 3 * 8 > BODY_I:
        # (this also bounds EXPERT_UP's shared pass table: at most min(E, B * A) + 1 <= E + 1 words)
        raise KernelLimit(f"{where}: {a['E']} experts (ROUTE's per-expert counts and starts, and its scan, "
                          f"take 2 E + 24 of the {BODY_I} shared int words below the instruction rows)")
    if 2 * a["B"] * a["A"] > SMEM_F:
        raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (ROUTE's picks and their ranks "
                          f"take 2 shared fp32 words each, of {SMEM_F})")


def run(vm, ins, a) -> None:
    """ROUTE in pyvm."""
    E, A, B = a["E"], a["A"], a["B"]
    logits = torch.stack([vm.rf(a["logits_off"] + t * E, E) for t in range(B)])
    if ins.flags & F_SIGMOID:
        scores = torch.sigmoid(logits)
        choice = scores + (vm.T[a["bias_w"]].float()[None] if a["bias_w"] >= 0 else 0)
        G = a["n_group"]
        if G > 1:
            grouped = choice.view(B, G, -1)
            gs = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool)
            keep.scatter_(1, torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :a["topk_group"]],
                          True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(B, E)
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :A]
        w = scores.gather(1, ids)
        if ins.flags & F_RENORM:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * bits_f32(a["scale_bits"])
    else:
        probs = torch.softmax(logits, dim=-1)
        ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :A]
        w = probs.gather(1, ids)
        if ins.flags & F_RENORM:
            w = w / w.sum(-1, keepdim=True)
    vm.wi(a["ids_off"], ids.flatten())
    vm.wf(a["wts_off"], w.flatten())
    flat = ids.flatten().tolist()
    uniq = sorted(set(flat))
    pstart, ptok, pslot, pairof = [0], [], [], [0] * (B * A)
    for e in uniq:
        for j, x in enumerate(flat):
            if x == e:
                pairof[j] = len(ptok)
                ptok.append(j // A)
                pslot.append(j % A)
        pstart.append(len(ptok))
    qst = [0]
    for u in range(len(uniq)):
        qst.append(qst[-1] + -(-(pstart[u + 1] - pstart[u]) // PASS))
    vm.wi(a["nuniq_off"], [len(uniq)])
    vm.wi(a["qst_off"], qst)
    vm.wi(a["uniq_off"], uniq)
    vm.wi(a["pstart_off"], pstart)
    vm.wi(a["ptok_off"], ptok)
    vm.wi(a["pslot_off"], pslot)
    vm.wi(a["pairof_off"], pairof)
