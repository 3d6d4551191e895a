"""Evidence reports: what a reviewer reads instead of the kernel code.

One self-contained HTML file (plots embedded as PNG data URIs, no external assets) and a short markdown
summary, built from a variant's manifest, its validation matrix rows, its audit results, its performance rows
(bench JSON), the environment and what the run covered. The page says first what was covered (device, compiled
or interpreted, dtypes run and not run, GPU-only checks run or not, extra cases, audits), so a reviewer tells at a
glance whether bf16 on the GPU was proven; then the verdict, which counts audits and SKIPs: FAIL when any cell or
audit failed, NOT RUN when no cell passed (a run that proved nothing never reads as a pass); then the tolerance
table with its derivation (validate/tolerances.py) and per-dtype error plots with the tolerance drawn
(report_plots.py; matplotlib, the `report` extra: without it the report says so and keeps the tables).
`inputs_hash` (what the evidence depends on: the variant's sources and the harness) lets
`bench/stale_reports.py` find reports to regenerate.
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from pathlib import Path

import jinja2
import torch

from .report_plots import error_plots
from .tolerances import derivation_text

ERROR_KEYS = ("max_rel_err", "mean_rel_err", "margin")
TOL_KEYS = ("tol_max_rel", "tol_mean_rel", "ref_dt_max_rel", "ref_dt_mean_rel", "max_rel_err", "mean_rel_err", "margin")


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from ..measure import git_sha

    env["git_sha"] = git_sha()
    return env


def _status_counts(rows: list[dict]) -> dict[str, int]:
    c = Counter(r.get("status", "?") for r in rows)
    return {k: c.get(k, 0) for k in ("PASS", "FAIL", "SKIP")} | {k: v for k, v in c.items()
                                                                if k not in ("PASS", "FAIL", "SKIP")}


def _audit_passed(a) -> bool | None:
    return a.passed if hasattr(a, "passed") else None


def verdict_of(rows: list[dict], audits: list) -> tuple[str, str]:
    """(verdict, why). Suites of expected failures (the ordering audit's planted bugs) carry one "verdict" row per
    subject: the verdict is theirs (caught as expected). Otherwise FAIL on any failing cell or audit, NOT RUN when
    no cell passed, PASS."""
    judged = [r for r in rows if r.get("check") == "verdict"]
    failed_audits = [a for a in audits if _audit_passed(a) is False]
    if judged:
        c = _status_counts(judged)
        v = "FAIL" if c["FAIL"] else ("PASS" if c["PASS"] else "NOT RUN")
        return v, f"{c['PASS']} subjects judged as expected, {c['FAIL']} not, {c['SKIP']} undecided here"
    c = _status_counts(rows)
    if c["FAIL"] or failed_audits:
        return "FAIL", f"{c['FAIL']} failing cells, {len(failed_audits)} failing audits"
    if not c["PASS"]:
        return "NOT RUN", f"no cell ran ({c['SKIP']} skipped): nothing was proven"
    return "PASS", f"{c['PASS']} cells passed, {c['SKIP']} skipped, {len(audits)} audits passed"


def coverage_of(rows: list[dict], audits: list, env: dict, extra: dict | None = None) -> dict:
    """What the run covered, from its rows (module doc)."""
    ran = [r for r in rows if r.get("status") in ("PASS", "FAIL") and r.get("dtype")]
    skipped = [r for r in rows if r.get("status") == "SKIP" and r.get("dtype")]
    dtypes_run = sorted({r["dtype"] for r in ran})
    not_run = {r["dtype"]: r.get("reason", "") for r in skipped if r["dtype"] not in dtypes_run}
    on_gpu = any(str(r.get("device", "")).startswith("cuda") for r in ran)
    cov = {"device": env.get("gpu", "?"),
           "execution": "compiled, on the GPU" if on_gpu else ("CPU (Triton kernels under the interpreter)"
                                                              if ran else "nothing ran"),
           "dtypes run": ", ".join(dtypes_run) or "none",
           "dtypes not run": "; ".join(f"{k}: {v}" for k, v in sorted(not_run.items())) or "none",
           "GPU-only checks (graph replay, concurrent streams, repeats under load, launch order)":
               "run on every GPU cell" if on_gpu else "NOT run (no GPU)",
           "extra cases": ", ".join(sorted({r.get("case") for r in ran if r.get("case") not in (None, "base")}))
                          or "none",
           "case families": ", ".join(sorted({r["case_family"] for r in ran
                                              if r.get("case_family") not in (None, "base")})) or "none",
           "static audits": f"{sum(1 for a in audits if _audit_passed(a))} of {len(audits)} kernels pass"
                            if audits else "no kernel declared (plain torch) or none run",
           "bf16 on a GPU": ("proven: " + f"{sum(1 for r in ran if r['dtype'] == 'bfloat16' and r['status'] == 'PASS')}"
                             " cells pass") if on_gpu and "bfloat16" in dtypes_run else "NOT proven by this run"}
    cov.update(extra or {})
    return cov


def tolerance_table(rows: list[dict]) -> list[dict]:
    """Per (op, dtype): the derived bounds (min..max over cells), the dtype reference's own errors, the variant's
    worst errors and its worst margin (error / bound), and the bounds' source."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") in ("PASS", "FAIL") and isinstance(r.get("tol_max_rel"), float):
            groups.setdefault((r.get("op"), r.get("dtype")), []).append(r)
    out = []
    for (op, dtype), rs in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        row = {"op": op, "dtype": dtype, "cells": len(rs)}
        for k in TOL_KEYS:
            vals = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            if vals:
                row[k] = f"{min(vals):.2g}..{max(vals):.2g}" if k.startswith(("tol", "ref")) else f"{max(vals):.2g}"
        row["source"] = "; ".join(sorted({r.get("tol_source", "?").split(" (")[0] for r in rs}))
        out.append(row)
    return out


def _table(rows: list[dict], keys: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    keys = keys or sorted({k for r in rows for k in r})
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    return keys, [[fmt(r.get(k)) for k in keys] for r in rows]


_HTML = jinja2.Template("""<!doctype html>
<html><head><meta charset="utf-8"><title>megadecode evidence: {{ name }}</title>
<style>
body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}
.PASS{background:#e3f4e3}.FAIL{background:#f8d7d7}.SKIP{background:#eee}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
</style></head><body>
<h1>Evidence report: {{ name }}</h1>
<h2>Coverage</h2>
<table>{% for k, v in coverage %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
<p><b>Verdict:</b> {{ verdict }} &mdash; {{ why }} ({{ counts }}; audits: {{ audit_counts }})</p>
<h2>Manifest</h2><pre>{{ manifest }}</pre>
<h2>Tolerances</h2><p>{{ derivation }}</p>
{% if tkeys %}<table><tr>{% for k in tkeys %}<th>{{ k }}</th>{% endfor %}</tr>
{% for r in trows %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% else %}<p>no cell with a floating output ran</p>{% endif %}
<h2>Validation matrix</h2>
{% for dtype, plot in plots %}<img src="{{ plot }}" alt="errors and tolerances, {{ dtype }}">{% else %}<p>(no error
plot: matplotlib missing or no numeric error columns)</p>{% endfor %}
<table><tr>{% for k in mkeys %}<th>{{ k }}</th>{% endfor %}</tr>
{% for r, st in mrows %}<tr class="{{ st }}">{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>
<h2>Audits (static and dynamic)</h2>
{% for a in audits %}<pre>{{ a }}</pre>{% else %}<p>none recorded</p>{% endfor %}
<h2>Performance against the baseline</h2>
{% if pkeys %}<table><tr>{% for k in pkeys %}<th>{{ k }}</th>{% endfor %}</tr>
{% for r in prows %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% else %}<p>no bench rows given</p>{% endif %}
<h2>Environment</h2><pre>{{ env }}</pre>
<h2>Reproduce</h2><pre>{{ command }}</pre>
</body></html>""", autoescape=True)


def build_report(name: str, manifest: dict, rows: list[dict], audits: list, perf_rows: list[dict],
                 env: dict, command: str, coverage: dict | None = None) -> tuple[str, str]:
    """Returns (html, markdown). `coverage`: extra coverage lines (the sampled cases, the inputs hash)."""
    counts = _status_counts(rows)
    verdict, why = verdict_of(rows, audits)
    cov = coverage_of(rows, audits, env, coverage)
    judged = [r for r in rows if r.get("check") == "verdict"]
    audit_texts = [a.to_markdown() if hasattr(a, "to_markdown") else
                   (a if isinstance(a, str) else json.dumps(a, indent=1, default=str)) for a in audits]
    n_ok = sum(1 for a in audits if _audit_passed(a))
    judged_audits = [a for a in audits if _audit_passed(a) is not None]
    audit_counts = (f"{n_ok} PASS, {len(judged_audits) - n_ok} FAIL of {len(judged_audits)}" if judged_audits
                    else f"{len(audits)} recorded, judged in the rows")
    tol = tolerance_table(rows)
    tkeys, tvals = _table(tol, ["op", "dtype", "cells", *TOL_KEYS, "source"]) if tol else ([], [])
    mkeys, mvals = _table(rows)
    pkeys, pvals = _table(perf_rows) if perf_rows else ([], [])
    count_text = ", ".join(f"{k} {v}" for k, v in counts.items())
    page = _HTML.render(
        name=name, verdict=verdict, why=why, counts=count_text, audit_counts=audit_counts,
        coverage=list(cov.items()), manifest=json.dumps(manifest, indent=1, default=str),
        derivation=derivation_text(), tkeys=tkeys, trows=tvals, plots=list(error_plots(rows).items()),
        mkeys=mkeys, mrows=list(zip(mvals, [r.get("status", "") for r in rows])),
        audits=audit_texts, pkeys=pkeys, prows=pvals, env=json.dumps(env, indent=1), command=command)
    md = [f"# Evidence summary: {name}", "", f"**Verdict: {verdict}** ({why}; cells: {count_text}; audits: "
          f"{audit_counts})", "", "## Coverage", "", "| what | covered |", "|---|---|"]
    md += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in cov.items()]
    md += ["", f"Reproduce: `{command}`", "", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    if judged:
        md += ["## Verdicts", "", "| subject | expected | status | caught by / reason |", "|---|---|---|---|"]
        md += [f"| {r.get('variant')} | {r.get('expected')} | {r.get('status')} | "
               f"{r.get('caught_by') or r.get('reason') or ''} |" for r in judged] + [""]
    fails = [r for r in rows if r.get("status") == "FAIL"]
    if fails:
        md += ["## Failing checks" + (" (expected ones included)" if judged else ""), ""]
        md += ["- " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "status" and v is not None)
               for r in fails[:40]] + [""]
    if tol:
        md += ["## Tolerances", "", derivation_text(), "", "| " + " | ".join(tkeys) + " |", "|" + "---|" * len(tkeys)]
        md += ["| " + " | ".join(r) + " |" for r in tvals] + [""]
    numeric = {k: [r[k] for r in rows if isinstance(r.get(k), (int, float))] for k in ERROR_KEYS}
    numeric = {k: v for k, v in numeric.items() if v}
    if numeric:
        md += ["## Errors over the matrix", "", "| metric | runs | worst | median |", "|---|---|---|---|"]
        for k, v in numeric.items():
            s = sorted(v)
            md.append(f"| {k} | {len(s)} | {s[-1]:.3g} | {s[len(s) // 2]:.3g} |")
        md.append("")
    if audit_texts:
        md += ["## Audits", ""] + [t if t.startswith("#") else f"```\n{t}\n```" for t in audit_texts] + [""]
    if perf_rows:
        md += ["## Performance", "", "| " + " | ".join(pkeys) + " |", "|" + "---|" * len(pkeys)]
        md += ["| " + " | ".join(r) + " |" for r in pvals] + [""]
    return page, "\n".join(md)


def write_report(out_dir: str | Path, name: str, **kw) -> tuple[Path, Path]:
    page, md = build_report(name, **kw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h, m = out / f"{name}.html", out / f"{name}.md"
    h.write_text(page)
    m.write_text(md)
    return h, m
