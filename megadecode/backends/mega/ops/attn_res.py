"""ATTN_RES: Block Attention Residuals (kimi_k3) for token b, columns [c0, c1): the attention of query_w over the
RMSNorm'd sources (nsrc consecutive [B, D] blocks at src_off) -> out[b, c0:c1] = sum_s alpha_s src_s"""

from __future__ import annotations

import torch

from ..isa import bits_f32
from ..limits import SMEM_F, KernelLimit
from ..pyvm_ops import rms
from .opcode import Opcode

OP = Opcode("ATTN_RES", ("k3", "op_attn_res"), dtypes={"query_w": torch.bfloat16, "norm_w": torch.bfloat16},
            lengths={"D": 8}, aligned=("src_off", "D"))


def check(prog, ins, where: str) -> None:
    if ins.args["nsrc"] > SMEM_F:
        raise KernelLimit(f"{where}: {ins.args['nsrc']} AttnRes sources")


def run(vm, ins, a) -> None:
    """ATTN_RES in pyvm."""
    B, D, b, c0, c1 = a["B"], a["D"], a["b"], a["c0"], a["c1"]
    src = torch.stack([vm.rf(a["src_off"] + (s * B + b) * D, D) for s in range(a["nsrc"])])  # [S, D]
    keys = rms(src, vm.T[a["norm_w"]], bits_f32(a["eps_bits"]))
    alpha = torch.softmax(keys @ vm.T[a["query_w"]].float(), dim=0)
    vm.wf(a["out_off"] + b * D + c0, alpha @ src[:, c0:c1])
