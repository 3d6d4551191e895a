"""The static audit of a variant's declared kernels (Manifest.kernels), in every `validate` mode.

Every spec a variant declares is compiled for sm_90 and audited (validate/audit.py); a variant passes its audit
when every declared kernel does, and fails when it declares none while running Triton (registration refuses
that already) or when a kernel does not compile. Results are cached per spec (its `key()`) for the process:
compiling costs ~0.3-1 s per kernel on the CPU (Triton's own disk cache makes a repeat faster).

Kernels decorated under the Triton interpreter (TRITON_INTERPRET=1, the CPU) cannot be compiled in this process:
their specs travel as JSON (`portable()`) to one fresh Python process without TRITON_INTERPRET, with this
process's import path, which rebuilds them by module and name (or from their source file) and audits them there.
So a variant registered anywhere, not only in the catalog, is audited.

    python -m megadecode.validate.kernel_audit < specs.json > reports.json   (the fresh process's side)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..contract import check_kernels
from ..contract.kernels import KernelSpec, from_portable
from .audit import AuditReport, audit_spec

_CACHE: dict[str, AuditReport] = {}
TIMEOUT_S = 900


def _failed(spec_name: str, why: str, path: dict | None = None) -> AuditReport:
    return AuditReport(spec_name, "cuda:sm_90", [], error=why, path=dict(path or {}))


def _audit_here(spec, arch: int = 90, sass: bool = True) -> AuditReport:
    try:
        rep = audit_spec(spec, arch=arch, sass=sass)
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile fails its audit, with the reason)
        return _failed(spec.name, f"{type(e).__name__}: {e}", _path(spec))
    rep.path = _path(spec)
    return rep


def _path(spec) -> dict:
    return spec.path_values() if hasattr(spec, "path_values") else {}


def _audit_elsewhere(specs: list, arch: int, sass: bool) -> list[AuditReport]:
    """Audit specs in a fresh process without TRITON_INTERPRET (kernels decorated for the interpreter here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    doc = json.dumps({"arch": arch, "sass": sass, "specs": [s.portable() for s in specs]})
    try:
        p = subprocess.run([sys.executable, "-m", "megadecode.validate.kernel_audit"], input=doc, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [_failed(s.name, f"the audit process took more than {TIMEOUT_S} s", _path(s)) for s in specs]
    if p.returncode != 0:
        why = f"the audit process failed (exit {p.returncode}): {p.stderr.strip()[-600:]}"
        return [_failed(s.name, why, _path(s)) for s in specs]
    return [AuditReport.from_dict(d) for d in json.loads(p.stdout.strip().splitlines()[-1])]


def audit_specs(specs: list, *, unique: bool = False, arch: int = 90, sass: bool = True) -> list[AuditReport]:
    """One report per spec (per distinct spec, by key, when `unique`), each spec audited once per process."""
    key = lambda s: (s.key(), arch, sass)  # noqa: E731
    distinct = list({key(s): s for s in specs}.values())
    todo = [s for s in distinct if key(s) not in _CACHE]
    here = [s for s in todo if not s.needs_fresh_process()]
    away = [s for s in todo if s.needs_fresh_process()]
    for s in here:
        _CACHE[key(s)] = _audit_here(s, arch, sass)
    if away:
        for s, rep in zip(away, _audit_elsewhere(away, arch, sass)):
            _CACHE[key(s)] = rep
    return [_CACHE[key(s)] for s in (distinct if unique else specs)]


def audit_kernel(fn, signature: dict[str, str], roles: dict[str, str], constexprs: dict | None = None,
                 *, arch: int = 90, sass: bool = True) -> AuditReport:
    """Compile the @triton.jit `fn` (`signature`: every argument -> Triton type or "constexpr") for sm_<arch>
    and audit it with explicit pointer roles (the handoff kernel's parameters are not named ..._ptr). ValueError
    when the description does not fit the kernel (checked here, before any compile)."""
    spec = KernelSpec(fn, signature, roles, dict(constexprs or {}))
    spec.check()
    return audit_specs([spec], arch=arch, sass=sass)[0]


def audit_variant(variant) -> list[AuditReport]:
    """The audits of every kernel the variant declares (none for a plain-torch variant)."""
    try:
        specs = check_kernels(variant)
    except ValueError as e:  # registered before the rule, or built by hand: a failure, not a skip
        return [_failed(variant.name, str(e))]
    return audit_specs(specs, unique=True) if specs else []


def audit_rows(variant, reports: list[AuditReport]) -> list[dict]:
    """Report rows: one per audited kernel (what the matrix report and its verdict count)."""
    return [{"variant": variant.name, "check": "static-audit", "kernel": r.kernel,
             "path": ", ".join(f"{k}={v}" for k, v in r.path.items()) or None,
             "status": "PASS" if r.passed else "FAIL",
             "findings": r.error or ",".join(sorted({f.rule for f in r.errors})) or None} for r in reports]


def _main() -> int:
    doc = json.loads(sys.stdin.read())
    reports = []
    for d in doc["specs"]:
        try:
            spec = from_portable(d)
        except Exception as e:  # noqa: BLE001  (a kernel this process cannot import fails its audit)
            name = str(d.get("qualname") or d.get("name") or d.get("kind"))
            reports.append(_failed(name, f"cannot rebuild the kernel here: {type(e).__name__}: {e}").to_dict())
            continue
        reports.append(_audit_here(spec, doc["arch"], doc["sass"]).to_dict())
    print(json.dumps(reports, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
