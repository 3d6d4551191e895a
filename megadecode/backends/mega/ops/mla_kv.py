"""MLA_KV: MLA: the token's latent (RMSNorm) and rope key (rotated) into the cache"""

from __future__ import annotations

import torch

from ..isa import F_INTERLEAVED, F_NOPE, bits_f32
from ..pyvm_ops import rope, rms
from .opcode import Opcode

OP = Opcode("MLA_KV", ("attention", "op_mla_kv"),
            dtypes={"cache": torch.bfloat16, "norm_w": torch.bfloat16, "rope_w": torch.float32}, produced=("cache",),
            lengths={"C": 8, "R": 8})


def run(vm, ins, a) -> None:
    """MLA_KV in pyvm."""
    C, R, b = a["C"], a["R"], a["b"]
    pos, slot = int(vm.ri(a["pos_off"] + b, 1)), int(vm.ri(a["slot_off"] + b, 1))
    kv = vm.rf(a["kva_off"] + b * a["kva_stride"], C + R)
    lat = rms(kv[:C], vm.T[a["norm_w"]], bits_f32(a["eps_bits"]))
    pe = kv[C:] if ins.flags & F_NOPE else rope(kv[C:], pos, vm.T[a["rope_w"]], bits_f32(a["att_bits"]),
                                                  bool(ins.flags & F_INTERLEAVED))
    vm.cache_row(a["cache"], (slot, pos), write=torch.cat((lat, pe)))
