"""MERGE: o[b, head*dv:(head+1)*dv] = merge of the S partials of (b, head) [MLA: then W_UV of the head; K3: then
times sigmoid(gate[b, head*dv + v]) (gate_off -1: no gate)]"""

from __future__ import annotations

import torch

from ..limits import SMEM_F, KernelLimit
from .opcode import Opcode

OP = Opcode("MERGE", ("dense", "op_merge"), dtypes={"wuv": torch.bfloat16})


def check(prog, ins, where: str) -> None:
    a = ins.args
    if a["wuv"] >= 0 and (a["d"] % 8 or a["d"] > SMEM_F - 128):
        # (the merged latent in shared words 0 .. d; the splits' maxima and weights in the last 128)
        raise KernelLimit(f"{where}: latent width {a['d']} (a multiple of 8, at most {SMEM_F - 128})")
    if a["S"] > 64:
        raise KernelLimit(f"{where}: {a['S']} attention splits (MERGE's split weights take 64 shared words)")


def run(vm, ins, a) -> None:
    """MERGE in pyvm."""
    b, h, S, H, d = (a[k] for k in ("b", "h", "S", "H", "d"))
    parts = torch.stack([vm.rf(a["part_off"] + ((b * H + h) * S + s) * (d + 2), d + 2) for s in range(S)])
    m, lsum, acc = parts[:, 0], parts[:, 1], parts[:, 2:]
    M = m.max()
    wgt = torch.where(torch.isfinite(m), torch.exp(m - M), torch.zeros_like(m))
    o = (wgt[:, None] * acc).sum(0) / (wgt * lsum).sum()
    if a["wuv"] >= 0:  # MLA: the head's value up-projection on the latent output
        P, dv = a["P"], a["dv"]
        W = vm.T[a["wuv"]][h * (P + dv) + P:h * (P + dv) + P + dv].float()  # [V, C]
        o = W @ o
    if a["gate_off"] >= 0:  # kimi_k3's output gate, per (head, value) element
        o = o * torch.sigmoid(vm.rf(a["gate_off"] + b * a["out_stride"] + h * a["dv"], a["dv"]))
    vm.wf(a["out_off"] + b * a["out_stride"] + h * a["dv"], o)
