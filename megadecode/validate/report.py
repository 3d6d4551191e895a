"""Evidence reports: what a reviewer reads instead of the kernel code.

One self-contained HTML file (plots embedded as PNG data URIs, no external assets) and a short
markdown summary, built from a variant's manifest, its validation matrix rows, its audit results,
its performance rows (bench JSON) and the environment. Plots use matplotlib when it is installed
(the `report` extra); without it the report says so and keeps the tables.
"""

from __future__ import annotations

import base64
import io
import json
import math
import platform
from collections import Counter
from pathlib import Path

import jinja2
import torch

ERROR_KEYS = ("max_rel_err", "max_abs_err", "mean_abs_err")


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


def _error_plot(rows: list[dict]) -> str | None:
    """PNG data URI: histogram of log10(error) per error kind over the rows that ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series = {k: [r[k] for r in rows if isinstance(r.get(k), (int, float)) and r.get("status") != "SKIP"]
              for k in ERROR_KEYS}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.0), squeeze=False)
    for ax, (k, vals) in zip(axes[0], series.items()):
        logs = [math.log10(v) if v > 0 else -12.0 for v in vals]
        ax.hist(logs, bins=30, color="#3b6ea5")
        ax.set_title(f"{k} ({len(vals)} runs)")
        ax.set_xlabel("log10(error); exact = -12")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


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
<p><b>Verdict:</b> {{ verdict }} &mdash; {{ counts }}</p>
<h2>Manifest</h2><pre>{{ manifest }}</pre>
<h2>Validation matrix</h2>
{% if plot %}<img src="{{ plot }}" alt="error distributions">{% else %}<p>(no error plot: matplotlib
missing or no numeric error columns)</p>{% endif %}
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
                 env: dict, command: str) -> tuple[str, str]:
    """Returns (html, markdown)."""
    counts = _status_counts(rows)
    # Suites of expected failures (deliberately broken variants) carry one "verdict" row per subject:
    # the verdict is theirs (caught as expected), not the raw count of failing checks.
    judged = [r for r in rows if r.get("check") == "verdict"] or rows
    jc = _status_counts(judged)
    verdict = "FAIL" if jc.get("FAIL") else ("PASS" if jc.get("PASS") else "NOT RUN")
    audit_texts = [a.to_markdown() if hasattr(a, "to_markdown") else
                   (a if isinstance(a, str) else json.dumps(a, indent=1, default=str)) for a in audits]
    mkeys, mvals = _table(rows)
    pkeys, pvals = _table(perf_rows) if perf_rows else ([], [])
    page = _HTML.render(
        name=name, verdict=verdict, counts=", ".join(f"{k} {v}" for k, v in counts.items()),
        manifest=json.dumps(manifest, indent=1, default=str), plot=_error_plot(rows),
        mkeys=mkeys, mrows=list(zip(mvals, [r.get("status", "") for r in rows])),
        audits=audit_texts, pkeys=pkeys, prows=pvals, env=json.dumps(env, indent=1), command=command)
    md = [f"# Evidence summary: {name}", "", f"**Verdict: {verdict}** ({', '.join(f'{k} {v}' for k, v in counts.items())})",
          "", f"Reproduce: `{command}`", "", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    if judged is not rows:
        md += ["## Verdicts", "", "| subject | expected | status | caught by / reason |", "|---|---|---|---|"]
        md += [f"| {r.get('variant')} | {r.get('expected')} | {r.get('status')} | "
               f"{r.get('caught_by') or r.get('reason') or ''} |" for r in judged] + [""]
    fails = [r for r in rows if r.get("status") == "FAIL"]
    if fails:
        md += ["## Failing checks" + (" (expected ones included)" if judged is not rows else ""), ""]
        md += ["- " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "status" and v is not None)
               for r in fails[:40]] + [""]
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
