"""MATVEC: out[t, out_col + r] (+)= W[r, :K] . f(x[t, :K] (+ x2[t, :K])) (+ add0[t, r] + add1[t, r]) for r in [r0,
r1), t < B; f = RMSNorm when F_NORM; x2 / add0 / add1 offsets -1: none (same strides as x / out)"""

from __future__ import annotations

import torch

from ..isa import F_RESID, F_TC, F_WRITE_NORMED, TC_K
from ..limits import KernelLimit
from .opcode import Opcode

OP = Opcode("MATVEC", ("dense", "op_matvec"), dtypes={"w": torch.bfloat16, "norm_w": torch.bfloat16}, lengths={"K": 8},
            aligned=("x_off", "x_stride", "x2_off"))


def check(prog, ins, where: str) -> None:
    a = ins.args
    if a["B"] > 64:
        raise KernelLimit(f"{where}: {a['B']} rows (the norm's per-row scales hold 64)")
    if ins.flags & F_TC and (a["K"] % TC_K or a["B"] < 2):
        raise KernelLimit(f"{where}: F_TC (tensor-core rows) needs K a multiple of {TC_K} and 2 tokens or more; "
                          f"K = {a['K']}, B = {a['B']}")


def run(vm, ins, a) -> None:
    """MATVEC in pyvm."""
    W = vm.T[a["w"]][a["r0"]:a["r1"]]
    vm.write_rows(a, vm.rows_times(ins, a, W), bool(ins.flags & F_RESID))
    if ins.flags & F_WRITE_NORMED and a["r0"] == 0:
        x = vm.normed(ins, a)
        for t in range(a["B"]):
            vm.wf(a["normed_off"] + t * a["K"], x[t])
