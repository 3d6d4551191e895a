"""The static ordering audit (validate/audit.py) of the CuTe DSL megakernel, through its declaration
(backends/mega/spec.py MegaKernelSpec): its PTX from a compile without a GPU, and its SASS where ptxas and nvdisasm are
found, against the roles its parameters play and what its address tables point to. `plant_verdicts` audits the
harness's planted builds (validate/mega_plants.py): each must be caught by the rules it names, and the controls
must pass."""

from __future__ import annotations

from ..backends.mega.spec import MegaKernelSpec
from .audit import AuditReport, audit_spec
from .mega_plants import CONTROLS, PLANTS, audit_plant


def audit_megakernel(sass: bool = True) -> AuditReport:
    return audit_spec(MegaKernelSpec(), arch=90, sass=sass)


def audit_rules(caught_by: tuple[str, ...]) -> list[str]:
    return [c.split(":", 1)[1] for c in caught_by if c.startswith("audit:")]


def plant_verdicts() -> tuple[list[dict], list[AuditReport]]:
    """One verdict row per plant and control (validate/report.py's "verdict" rows) and the audit reports: a plant
    whose catchers include audit rules is PASS when every one of them fires; one caught only on the GPU is SKIP
    here (bench/mega_plants_gpu.py runs it); a control is PASS when its audit passes."""
    rows, reports = [], []
    for p in list(PLANTS.values()) + list(CONTROLS.values()):
        rules = audit_rules(p.caught_by)
        gpu = [c for c in p.caught_by if c.startswith("gpu:")]
        row = {"variant": f"mega_kernel+{p.name}", "check": "verdict", "what": p.what,
               "expected": ("caught by " + ", ".join(p.caught_by)) if p.caught_by else "passes the audit"}
        if p.caught_by and not rules:
            rows.append({**row, "status": "SKIP", "reason": f"caught on the GPU ({', '.join(gpu)}): "
                         "bench/mega_plants_gpu.py"})
            continue
        rep = audit_plant(p.name)
        reports.append(rep)
        fired = sorted({f.rule for f in rep.errors})
        ok = set(rules) <= set(fired) if p.caught_by else rep.passed
        rows.append({**row, "status": "PASS" if ok else "FAIL", "caught_by": ", ".join(fired) or "nothing"})
    return rows, reports
