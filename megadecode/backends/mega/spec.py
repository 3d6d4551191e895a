"""The megakernel's declaration for the static ordering audit (the interface of megadecode.contract.kernels): its
parameters in PTX order, the role each plays, what its address tables point to, and how to compile it without a GPU.
No cutlass import here.

Roles: the instruction stream, its queues and both address tables are static; the counters are the flags (waits
acquire them, signals release them); the arenas (activations, routing), the error buffer and the timeline are
produced during the launch. Weights and caches are reached through the address tables: `wtab` holds the static
tensors' addresses, `ptab` those of the tensors the launch writes (caches, recurrent states), so the audit traces
every load through the table its address came from (`pointees`) and proves that a non-coherent load reads only
static tensors. `err` is where a wait that gives up reports (`reports`: the audit checks every spin loop's exit
writes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...contract.kernels import Compiled, register_spec_kind

AUDIT_PARAMS = ("prog", "qstart", "qorder", "ctr", "f32", "i32", "wtab", "ptab", "err", "max_spin", "tl", "timeline",
                "delay_ns")
AUDIT_ROLES = {"prog": "static", "qstart": "static", "qorder": "static", "wtab": "static", "ptab": "static",
               "ctr": "flag", "f32": "produced", "i32": "produced", "err": "produced", "tl": "produced"}
POINTEES = {"wtab": "static", "ptab": "produced"}
REPORTS = ("err",)


@dataclass(frozen=True)
class MegaKernelSpec:
    """The CuTe DSL megakernel as shipped (backends/mega/cute_kernel.py). The harness's planted variants
    (validate/mega_plants.py) subclass it."""

    path: tuple = ()

    @property
    def name(self) -> str:
        return "mega_kernel"

    @property
    def kernel_id(self) -> str:
        return "megadecode.backends.mega.cute_kernel.mega_kernel"

    @property
    def roles(self) -> dict:
        return dict(AUDIT_ROLES)

    @property
    def pointees(self) -> dict:
        return dict(POINTEES)

    @property
    def reports(self) -> tuple:
        return REPORTS

    @property
    def cta_signals(self) -> bool:
        """One thread signals for its whole CTA (after a block barrier)."""
        return True

    def key(self) -> str:
        return json.dumps(["cute", self.kernel_id])

    def needs_fresh_process(self) -> bool:
        return False  # CuTe DSL compiles beside the Triton interpreter

    def portable(self) -> dict:
        return {"kind": "cute"}

    def ptx(self) -> str:
        """The kernel's PTX, compiled without a GPU (once per process: cute_kernel.compile_for)."""
        from . import cute_kernel as K

        return K.compile_for().__ptx__

    def compile(self, arch: int = 90) -> Compiled:
        if arch != 90:
            raise ValueError(f"the megakernel is built for sm_90a, not sm_{arch}")
        from .runtime import assemble

        ptx = self.ptx()
        cubin, _ = assemble(ptx)
        return Compiled(ptx, cubin, list(AUDIT_PARAMS), set(AUDIT_ROLES))


register_spec_kind("cute", lambda d: MegaKernelSpec())
