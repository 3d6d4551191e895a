"""The static ordering audit (validate/audit.py) of the CuTe DSL megakernel: its PTX from a compile without a
GPU, and its SASS where ptxas and nvdisasm are found, against the roles its parameters play
(mega/cute_kernel.py AUDIT_ROLES: counters are flags, the arenas and the error buffer produced, the instruction
stream and tensor table static). The kernel reads no parameter through the non-coherent path: weights and caches
are reached through the tensor table's addresses with plain loads, activations with plain loads after the
acquire. `plant` compiles one of the kernel's deliberate mistakes (mega/cute_kernel.py PLANTS) instead."""

from __future__ import annotations

from .audit import AuditReport, audit_ptx, disassemble


def audit_megakernel(plant: str = "", sass: bool = True) -> AuditReport:
    from ..mega import cute_kernel as K
    from ..mega.runtime import assemble

    ptx = K.compile_for(plant).__ptx__
    text, why = None, "SASS not requested"
    if sass:
        cubin, report = assemble(ptx)
        text, why = disassemble(cubin) if cubin is not None else (None, report)
    return audit_ptx(ptx, list(K.AUDIT_PARAMS), K.AUDIT_ROLES, kernel="mega_kernel" + (f"+{plant}" if plant else ""),
                     target="cuda:sm_90a", pointer_params=set(K.AUDIT_ROLES), sass=text, sass_skip_reason=why)
