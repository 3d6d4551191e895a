"""The megakernel's opcodes, one module each, holding what the rest of the package needs of it:
- `OP` (opcode.Opcode): its name (the row layout is `isa.OPS[name]`, the one ISA table); its CuTe body, (module of
  cute/, function); the dtype the kernel reads each tensor argument as, the ones that are uint8 packed experts under
  F_MXFP4 instead, the tensors the launch writes (read from the produced address table; every other tensor is
  static); the multiple each length argument must be (the kernel's 8-wide loops; 32 under F_MXFP4) and the fp32
  offsets and strides its vector loops load from (multiples of 4: 16-byte loads);
- `check(prog, ins, where)`, where it has one: what else the body assumes (shared memory, tile shapes), raising
  limits.KernelLimit;
- `run(vm, ins, a)`: its semantics in pyvm, the golden model (plain torch).
kernel_check.py, pyvm.py and cute_kernel.py read these; adding an opcode is a row in isa.OPS, a module here, its body
in cute/ and its lowering."""

from __future__ import annotations

from . import (attn_gqa, attn_res, combine, embed, expert_down, expert_up, glu, kda_step, matvec, merge, mla_attn,
               mla_kv, mla_q, route, sample)

MODULES = (embed, matvec, glu, attn_gqa, merge, route, expert_up, expert_down, sample, mla_kv, mla_q, mla_attn,
           attn_res, kda_step, combine)
BY_NAME = {m.OP.name: m for m in MODULES}


def no_check(prog, ins, where: str) -> None:
    """An opcode whose body assumes nothing past its dtypes, lengths and alignment."""


def checker(name: str):
    """The opcode's `check` (NOP, and an opcode whose module has none: `no_check`)."""
    return getattr(BY_NAME.get(name), "check", no_check)
