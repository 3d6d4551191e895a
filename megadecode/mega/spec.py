"""The megakernel's declaration for the static ordering audit (the interface of megadecode.contract.kernels): its
parameters in PTX order and the role each plays, and how to compile it without a GPU. No cutlass import here.

Roles: the instruction stream, its queues and the tensor table are static; the counters are the flags (waits
acquire them, signals release them); the arenas (activations, routing), the error buffer and the timeline are
produced during the launch. Weights and caches are reached through the tensor table's addresses: their loads
carry no parameter, and the kernel reads nothing through the non-coherent path (the audit's SASS rule checks
ptxas did not promote a load to it either).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..contract.kernels import Compiled, register_spec_kind

AUDIT_PARAMS = ("prog", "qstart", "qorder", "ctr", "f32", "i32", "taddr", "err", "max_spin", "tl", "timeline",
                "delay_ns")
AUDIT_ROLES = {"prog": "static", "qstart": "static", "qorder": "static", "taddr": "static", "ctr": "flag",
               "f32": "produced", "i32": "produced", "err": "produced", "tl": "produced"}


@dataclass(frozen=True)
class MegaKernelSpec:
    """The CuTe DSL megakernel (mega/cute_kernel.py); `plant` compiles one of its deliberate ordering mistakes."""

    plant: str = ""
    path: tuple = ()

    @property
    def name(self) -> str:
        return "mega_kernel" + (f"+{self.plant}" if self.plant else "")

    @property
    def kernel_id(self) -> str:
        return "megadecode.mega.cute_kernel.mega_kernel"

    @property
    def roles(self) -> dict:
        return dict(AUDIT_ROLES)

    def key(self) -> str:
        return json.dumps(["cute", self.kernel_id, self.plant])

    def needs_fresh_process(self) -> bool:
        return False  # CuTe DSL compiles beside the Triton interpreter

    def portable(self) -> dict:
        return {"kind": "cute", "plant": self.plant}

    def compile(self, arch: int = 90) -> Compiled:
        if arch != 90:
            raise ValueError(f"the megakernel is built for sm_90a, not sm_{arch}")
        from . import cute_kernel as K
        from .runtime import assemble

        ptx = K.compile_for(self.plant).__ptx__
        cubin, _ = assemble(ptx)
        return Compiled(ptx, cubin, list(AUDIT_PARAMS), set(AUDIT_ROLES))


register_spec_kind("cute", lambda d: MegaKernelSpec(d.get("plant", "")))
