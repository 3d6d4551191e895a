"""The static ordering audit (validate/audit.py) of the CuTe DSL megakernel, through its declaration
(mega/spec.py MegaKernelSpec): its PTX from a compile without a GPU, and its SASS where ptxas and nvdisasm are
found, against the roles its parameters play. `plant` audits one of the kernel's deliberate mistakes instead
(mega/cute_kernel.py PLANTS), which the audit must catch."""

from __future__ import annotations

from ..mega.spec import MegaKernelSpec
from .audit import AuditReport, audit_spec


def audit_megakernel(plant: str = "", sass: bool = True) -> AuditReport:
    return audit_spec(MegaKernelSpec(plant), arch=90, sass=sass)
