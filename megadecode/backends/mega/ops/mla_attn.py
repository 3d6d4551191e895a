"""MLA_ATTN: MLA attention for (b, head block [h0, h0 + HB), split s of S) over the latent cache -> partials"""

from __future__ import annotations

import torch

from ..isa import bits_f32
from ..limits import MLA_HB, KernelLimit
from .opcode import Opcode

OP = Opcode("MLA_ATTN", ("attention", "op_mla_attn"), dtypes={"cache": torch.bfloat16}, produced=("cache",),
            lengths={"C": 8, "R": 8})


def check(prog, ins, where: str) -> None:
    if ins.args["HB"] > MLA_HB:
        raise KernelLimit(f"{where}: {ins.args['HB']} heads in one MLA attention instruction (at most {MLA_HB})")


def run(vm, ins, a) -> None:
    """MLA_ATTN in pyvm."""
    b, h0, HB, s, S, H, C, R = (a[k] for k in ("b", "h0", "HB", "s", "S", "H", "C", "R"))
    pos, slot = int(vm.ri(a["pos_off"] + b, 1)), int(vm.ri(a["slot_off"] + b, 1))
    L = pos + 1
    lo, hi = s * L // S, (s + 1) * L // S
    ql = torch.stack([vm.rf(a["qlat_off"] + (b * H + h) * C, C) for h in range(h0, h0 + HB)])
    qp = torch.stack([vm.rf(a["qpe_off"] + (b * H + h) * R, R) for h in range(h0, h0 + HB)])
    dev = vm.f32.device
    m = torch.full((HB,), float("-inf"), device=dev)
    lsum, acc = torch.zeros(HB, device=dev), torch.zeros(HB, C, device=dev)
    if hi > lo:
        rows = torch.stack([vm.cache_row(a["cache"], (slot, p)).float() for p in range(lo, hi)])
        sc = (ql @ rows[:, :C].T + qp @ rows[:, C:].T) * bits_f32(a["scale_bits"])
        m = sc.max(-1).values
        pr = torch.exp(sc - m[:, None])
        lsum, acc = pr.sum(-1), pr @ rows[:, :C]
    for j, h in enumerate(range(h0, h0 + HB)):
        vm.wf(a["part_off"] + ((b * H + h) * S + s) * (C + 2), torch.cat((m[j:j + 1], lsum[j:j + 1], acc[j])))
