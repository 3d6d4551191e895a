"""ROUTE: routing for the whole batch: picks, weights, and the pairs grouped by expert (see backends/mega/lower.py)
(also each expert's passes of PASS pairs, as a prefix: qst[u] = sum over u' < u of ceil(pairs(u') / PASS)).
Split past isa.ROUTE_SPLIT_B tokens: F_PICKS instructions take the picks and weights of tokens [t0, t1), then one
F_TABLES instruction the tables from the picks in ids."""

from __future__ import annotations

import torch

from ..isa import F_PICKS, F_RENORM, F_SIGMOID, F_TABLES, PASS, bits_f32
from ..limits import BODY_I, SMEM_F, KernelLimit
from .opcode import Opcode

OP = Opcode("ROUTE", ("moe", "op_route"), dtypes={"bias_w": torch.float32})


def check(prog, ins, where: str) -> None:
    a = ins.args
    if 2 * a["E"] + 3 * 8 > BODY_I:
        # (this also bounds EXPERT_UP's shared pass table: at most min(E, B * A) + 1 <= E + 1 words)
        raise KernelLimit(f"{where}: {a['E']} experts (ROUTE's per-expert counts and starts, and its scan, "
                          f"take 2 E + 24 of the {BODY_I} shared int words below the instruction rows)")
    if ins.flags & F_PICKS and not 0 <= a["t0"] < a["t1"] <= a["B"]:
        raise ValueError(f"{where}: F_PICKS tokens [{a['t0']}, {a['t1']}) not within the batch of {a['B']}")
    if ins.flags & F_PICKS and ins.flags & F_TABLES:
        raise ValueError(f"{where}: F_PICKS and F_TABLES together (a ROUTE without either takes both parts)")
    if 2 * a["B"] * a["A"] > SMEM_F:
        raise KernelLimit(f"{where}: {a['B']} x {a['A']} (token, expert) pairs (ROUTE's picks and their ranks "
                          f"take 2 shared fp32 words each, of {SMEM_F})")


def run(vm, ins, a) -> None:
    """ROUTE in pyvm: both parts, or under F_PICKS the picks of tokens [t0, t1), under F_TABLES the tables."""
    A = a["A"]
    if ins.flags & F_PICKS:
        ids, w = picks(vm, ins.flags, a, a["t0"], a["t1"])
        vm.wi(a["ids_off"] + a["t0"] * A, ids.flatten())
        vm.wf(a["wts_off"] + a["t0"] * A, w.flatten())
    elif ins.flags & F_TABLES:
        write_tables(vm, a, tables(vm.ri(a["ids_off"], a["B"] * A).tolist(), a["B"], A))
    else:
        write(vm, a, routing(vm, ins.flags, a))


def routing(vm, flags: int, a) -> dict:
    """ROUTE's outputs for the B tokens' logits at logits_off (B = 1 where `a` has no B: EXPERT_UP under F_ROUTE):
    picks, weights and the pairs grouped by expert, as lists."""
    ids, w = picks(vm, flags, a, 0, a.get("B", 1))
    return {"ids": ids.flatten(), "wts": w.flatten(), **tables(ids.flatten().tolist(), a.get("B", 1), a["A"])}


def picks(vm, flags: int, a, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The picked experts [t1 - t0, A] and their weights of tokens [t0, t1), from their logits at logits_off."""
    E, A, B = a["E"], a["A"], t1 - t0
    logits = torch.stack([vm.rf(a["logits_off"] + t * E, E) for t in range(t0, t1)])
    if flags & F_SIGMOID:
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
        if flags & F_RENORM:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * bits_f32(a["scale_bits"])
    else:
        probs = torch.softmax(logits, dim=-1)
        ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :A]
        w = probs.gather(1, ids)
        if flags & F_RENORM:
            w = w / w.sum(-1, keepdim=True)
    return ids, w


def tables(flat: list[int], B: int, A: int) -> dict:
    """The (token, slot) pairs of the picks `flat` (B x A, token-major) grouped by expert, experts ascending, pairs
    in (token, slot) order; each expert's pair prefix and pass prefix."""
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
    return {"nuniq": len(uniq), "uniq": uniq, "pstart": pstart, "ptok": ptok, "pslot": pslot, "pairof": pairof,
            "qst": qst}


def write(vm, a, r: dict) -> None:
    """`routing`'s outputs to the buffers ROUTE's arguments name."""
    vm.wi(a["ids_off"], r["ids"])
    vm.wf(a["wts_off"], r["wts"])
    write_tables(vm, a, r)


def write_tables(vm, a, r: dict) -> None:
    """`tables`' outputs to the buffers ROUTE's arguments name."""
    vm.wi(a["nuniq_off"], [r["nuniq"]])
    for k in ("qst", "uniq", "pstart", "ptok", "pslot", "pairof"):
        vm.wi(a[f"{k}_off"], r[k])
