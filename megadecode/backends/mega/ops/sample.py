"""SAMPLE: next token of sequence b from logits [B, V] (greedy, or temperature with the step's seed)"""

from __future__ import annotations

import torch

from ..isa import F_GREEDY, bits_f32
from ..pyvm_ops import gumbel
from .opcode import Opcode

OP = Opcode("SAMPLE", ("dense", "op_sample"))


def run(vm, ins, a) -> None:
    """SAMPLE in pyvm."""
    V, b = a["V"], a["b"]
    lg = vm.rf(a["logits_off"] + b * V, V)
    if ins.flags & F_GREEDY:
        tok = int(torch.argmax(lg))
    else:
        seed = int(vm.ri(a["seed_off"], 1))
        tok = int(torch.argmax(lg * bits_f32(a["inv_temp_bits"]) + gumbel(seed, b, V, lg.device)))
    vm.wi(a["tok_out_off"] + b, [tok])
    vm.wf(a["lp_out_off"] + b, (lg[tok] - torch.logsumexp(lg, 0)).reshape(1))
