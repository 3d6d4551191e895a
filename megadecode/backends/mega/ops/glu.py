"""GLU: out[t, out_col + r] = silu(Wg[r] . f(x_t)) * (Wu[r] . f(x_t))"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import matvec
from .opcode import Opcode

OP = Opcode("GLU", ("dense", "op_glu"), dtypes={"wg": torch.bfloat16, "wu": torch.bfloat16, "norm_w": torch.bfloat16},
            lengths={"K": 8}, aligned=("x_off", "x_stride", "x2_off"))


check = matvec.check  # the same rows loop (cute/dense.py)


def run(vm, ins, a) -> None:
    """GLU in pyvm."""
    g = vm.rows_times(ins, a, vm.T[a["wg"]][a["r0"]:a["r1"]])
    u = vm.rows_times(ins, a, vm.T[a["wu"]][a["r0"]:a["r1"]])
    vm.write_rows(a, F.silu(g) * u, False)
