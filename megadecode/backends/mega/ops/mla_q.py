"""MLA_Q: MLA: q_lat[b, head] = W_UK[head]^T q_nope, q_pe rotated"""

from __future__ import annotations

import torch

from ..isa import F_INTERLEAVED, F_NOPE, bits_f32
from ..pyvm_ops import rope
from .opcode import Opcode

OP = Opcode("MLA_Q", ("attention", "op_mla_q"), dtypes={"wkv": torch.bfloat16, "rope_w": torch.float32})


def run(vm, ins, a) -> None:
    """MLA_Q in pyvm."""
    b, h, H, P, R, C, V = (a[k] for k in ("b", "h", "H", "P", "R", "C", "V"))
    pos = int(vm.ri(a["pos_off"] + b, 1))
    q = vm.rf(a["qb_off"] + b * a["qb_stride"] + h * (P + R), P + R)
    W = vm.T[a["wkv"]][h * (P + V):h * (P + V) + P].float()  # [P, C]
    vm.wf(a["qlat_off"] + (b * H + h) * C, q[:P] @ W)
    pe = q[P:] if ins.flags & F_NOPE else rope(q[P:], pos, vm.T[a["rope_w"]], bits_f32(a["att_bits"]),
                                                 bool(ins.flags & F_INTERLEAVED))
    vm.wf(a["qpe_off"] + (b * H + h) * R, pe)
