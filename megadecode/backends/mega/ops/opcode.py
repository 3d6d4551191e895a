"""What one opcode's module declares of its arguments and body (the package doc says what each field means)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Opcode:
    name: str  # its row layout is isa.OPS[name]
    body: tuple[str, str]  # its CuTe body: (module of cute/, function)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # the dtype the kernel reads each tensor as
    mxfp4: tuple[str, ...] = ()  # the tensors that are uint8 packed experts under F_MXFP4 instead
    produced: tuple[str, ...] = ()  # the tensors the launch writes (the produced address table); others static
    lengths: dict[str, int] = field(default_factory=dict)  # the multiple each length must be (32 under F_MXFP4)
    aligned: tuple[str, ...] = ()  # fp32 offsets and strides loaded 16 bytes at a time (multiples of 4)
