"""What the CuTe kernel assumes of a program, checked before the launch (on the host, no GPU needed): the dtype of
every tensor an instruction names, the lengths its vector loops step through 8 at a time, the 16-byte alignment of
the activation rows those loops load, and the shared-memory bounds of the bodies that size their tiles at run time.
A program that breaks one is refused with the instruction and the reason, instead of reading past a row or
reinterpreting a tensor's bytes inside the kernel."""

from __future__ import annotations

import torch

from . import ops
from .isa import F_MXFP4
from .limits import BODY_I, MLA_HB, NT, SMEM_F, KernelLimit
from .program import Program

__all__ = ["BODY_I", "MLA_HB", "NT", "SMEM_F", "KernelLimit", "check_program", "check_ring"]  # the bounds, re-exported

U8 = torch.uint8

# What each opcode's module (ops/) declares (its OP), as the tables the check walks. (opcode, argument) -> the dtype the
# kernel reads it as; the arguments that are uint8 packed experts under F_MXFP4 instead; the tensors the launch
# writes, whose address the kernel reads from the produced table (`ptab`): every other tensor argument, and the
# static bytes an instruction declares (header words 10..12), come from the static table (`wtab`), whose loads may
# take the non-coherent path (backends/mega/spec.py), and a tensor in the wrong table would be read as address 0
DTYPES: dict[tuple[str, str], torch.dtype] = {(m.OP.name, a): t for m in ops.MODULES for a, t in m.OP.dtypes.items()}
MXFP4_ARGS = {(m.OP.name, a) for m in ops.MODULES for a in m.OP.mxfp4}
PRODUCED_ARGS = {(m.OP.name, a) for m in ops.MODULES for a in m.OP.produced}
# (opcode, argument) -> the multiple the kernel's 8-wide loops need (MXFP4 rows: a whole 32-weight block)
LENGTHS = {(m.OP.name, a): n for m in ops.MODULES for a, n in m.OP.lengths.items()}
# fp32 activation offsets and strides the vector loops load 8 at a time from (16-byte alignment: multiples of 4)
ALIGNED = {m.OP.name: m.OP.aligned for m in ops.MODULES}


def _tensor_args(op: str) -> list[str]:
    return sorted({a for (o, a) in DTYPES if o == op} | {a for (o, a) in MXFP4_ARGS if o == op})


def check_program(prog: Program) -> None:
    """Raise KernelLimit for the first instruction the CuTe kernel would read wrongly."""
    for ins in prog.instrs:
        a, op, where = ins.args, ins.op, ins.name or ins.op
        mx = bool(ins.flags & F_MXFP4)
        for name in _tensor_args(op):
            t = a.get(name, -1)
            if t < 0:
                continue
            role = "produced" if (op, name) in PRODUCED_ARGS else "static"
            if prog.tensors[t].role != role:
                raise KernelLimit(f"{where}: {name} ({prog.tensors[t].name}) is {prog.tensors[t].role}; the "
                                  f"megakernel reads it from the {role} table")
            want = U8 if mx and (op, name) in MXFP4_ARGS else DTYPES.get((op, name))
            got = prog.tensors[t].tensor.dtype
            if want is not None and got != want:
                raise KernelLimit(f"{where}: {name} ({prog.tensors[t].name}) is {got}; the megakernel reads it as "
                                  f"{want}")
        t = ins.prefetch[0]
        if t >= 0 and prog.tensors[t].role != "static":
            raise KernelLimit(f"{where}: declares {prog.tensors[t].name} ({prog.tensors[t].role}) as static bytes "
                              f"to stream")
        for (o, name), m in LENGTHS.items():
            if o == op:
                need = 32 if mx else m
                if a[name] % need:
                    raise KernelLimit(f"{where}: {name} = {a[name]} is not a multiple of {need} (the kernel's "
                                      f"{'MXFP4 blocks' if mx else 'vector loads'})")
        for name in ALIGNED.get(op, ()):
            if a.get(name, -1) > 0 and a[name] % 4:
                raise KernelLimit(f"{where}: {name} = {a[name]} is not a multiple of 4 fp32 (16-byte vector loads)")
        ops.checker(op)(prog, ins, where)


def check_ring(prog: Program) -> None:
    """What the weight ring's build assumes of the program's staged instructions (Program.stageable): each round of
    a staged body reads pages that the loader can all hold at once once the pages before the round are freed (at
    most RING_SLOTS; the kernel then never waits for a page the loader cannot issue), and every page is one bulk
    copy of whole 16-byte units. Raise KernelLimit naming the instruction otherwise."""
    from .limits import RING_PAGE, RING_SLOTS

    for ins in prog.instrs:
        if not prog.stageable(ins):
            continue
        for pa, pz in prog.ring_rounds(ins):
            if pz - pa + 1 > RING_SLOTS:
                raise KernelLimit(f"{ins.name}: a round of its staged rows reads pages {pa}..{pz}, more than the "
                                  f"ring's {RING_SLOTS} slots")
        if ins.prefetch[2] % 16 or RING_PAGE % 16:
            raise KernelLimit(f"{ins.name}: staged bytes {ins.prefetch[2]} are not whole 16-byte units")
