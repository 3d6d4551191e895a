"""EMBED: hidden[t, c0:c1] = embed[tokens[t], c0:c1]"""

from __future__ import annotations

import torch
from .opcode import Opcode

OP = Opcode("EMBED", ("dense", "op_embed"), dtypes={"w": torch.bfloat16})


def run(vm, ins, a) -> None:
    """EMBED in pyvm."""
    tok = vm.ri(a["tok_off"], a["B"])
    W = vm.T[a["w"]]
    for t in range(a["B"]):
        vm.wf(a["out_off"] + t * a["D"] + a["c0"], W[int(tok[t]), a["c0"]:a["c1"]].float())
