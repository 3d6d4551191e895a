"""Which evidence reports are stale: a report records a hash of everything its verdict depends on (the variant's
own sources, the harness's checks and tolerances, the reference ops); when the hash of those files now differs,
the report predates a change of its kernel, its checks or its tolerances and must be regenerated
(bench/stale_reports.py, bench/gpu_evidence.sh). Content hashes, not commits: the GPU machine's copy of the tree
has no .git."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the checks, their inputs and tolerances, and the reference they compare with
HARNESS = ("megadecode/validate/checks.py", "megadecode/validate/inputs.py", "megadecode/validate/cases.py",
           "megadecode/validate/tolerances.py", "megadecode/validate/guards.py", "megadecode/validate/launches.py",
           "megadecode/validate/gpu_checks.py", "megadecode/validate/matrix.py", "megadecode/validate/audit.py",
           "megadecode/validate/kernel_audit.py", "megadecode/contract", "megadecode/reference",
           "megadecode/backends/torch/ops.py")
ORDERING_SOURCES = ("megadecode/validate/handoff.py", "megadecode/validate/ordering.py")  # the ordering audit's
_LINE = re.compile(r"^\| inputs hash \| ([0-9a-f]{16}) \|", re.M)


def _files(paths) -> list[Path]:
    out = []
    for p in paths:
        f = ROOT / p
        out += sorted(f.rglob("*.py")) if f.is_dir() else ([f] if f.is_file() else [])
    return sorted(set(out))


def inputs_hash(sources: tuple[str, ...] | list[str]) -> str:
    """16 hex digits of the sha256 over the variant's sources and HARNESS (paths and contents)."""
    h = hashlib.sha256()
    for f in _files(list(sources) + list(HARNESS)):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def recorded_hash(report_md: str) -> str | None:
    m = _LINE.search(report_md)
    return m.group(1) if m else None


def stale_reason(sources, report: Path) -> str | None:
    """None when the report is current, else why it is stale."""
    if not report.is_file():
        return "no report"
    got = recorded_hash(report.read_text())
    if got is None:
        return "the report records no inputs hash (made before the harness recorded one)"
    now = inputs_hash(sources)
    return None if got == now else f"inputs changed since the report ({got} -> {now})"
