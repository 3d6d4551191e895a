"""The evidence report: self-contained HTML + markdown summary from matrix rows, audits and bench rows."""

from __future__ import annotations

from megadecode.validate.report import build_report, environment, write_report

ROWS = [
    {"op": "router", "batch": 1, "dtype": "float32", "status": "PASS", "max_rel_err": 1e-7, "max_abs_err": 2e-8},
    {"op": "router", "batch": 67, "dtype": "float32", "status": "FAIL", "max_rel_err": 0.5, "max_abs_err": 0.2,
     "reason": "row 66 differs"},
    {"op": "router", "batch": 8, "dtype": "bfloat16", "status": "SKIP", "reason": "bf16 needs a GPU"},
]


def test_report_has_every_section_and_the_verdict(tmp_path):
    h, m = write_report(tmp_path, "demo-variant", manifest={"name": "demo-variant", "replaces": ["router"]},
                        rows=ROWS, audits=["# audit\nno findings"],
                        perf_rows=[{"executor": "fused", "batch": 1, "mbu": 0.8}], env=environment(),
                        command="megadecode validate demo-variant --report")
    page, md = h.read_text(), m.read_text()
    for section in ("Manifest", "Validation matrix", "Audits", "Performance against the baseline", "Environment",
                    "Reproduce"):
        assert section in page
    assert "Verdict:</b> FAIL" in page and "**Verdict: FAIL**" in md
    assert "row 66 differs" in md  # failures are listed in the summary
    assert "src=\"http" not in page and "<script" not in page  # self-contained, no external assets
    assert "| max_rel_err | 2 | 0.5 |" in md


def test_all_pass_verdict_and_escaping():
    page, md = build_report("v", manifest={"note": "<b>x</b>"}, rows=[dict(ROWS[0])], audits=[], perf_rows=[],
                            env={"gpu": "none"}, command="c")
    assert "**Verdict: PASS**" in md
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page


def test_suites_of_planted_bugs_are_judged_by_their_verdict_rows():
    rows = [{"variant": "good", "check": "static-audit", "status": "PASS"},
            {"variant": "good", "check": "verdict", "expected": "clean", "status": "PASS"},
            {"variant": "broken-x", "check": "static-audit", "status": "FAIL", "findings": "nc-load-of-produced"},
            {"variant": "broken-x", "check": "verdict", "expected": "flagged", "caught_by": "static-audit",
             "status": "PASS"}]
    _, md = build_report("suite", manifest={}, rows=rows, audits=[], perf_rows=[], env={}, command="c")
    assert "**Verdict: PASS**" in md and "| broken-x | flagged | PASS | static-audit |" in md
    rows[-1] = dict(rows[-1], status="FAIL", caught_by=None, reason="not caught")
    _, md = build_report("suite", manifest={}, rows=rows, audits=[], perf_rows=[], env={}, command="c")
    assert "**Verdict: FAIL**" in md
