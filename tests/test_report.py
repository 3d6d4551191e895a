"""The evidence report: self-contained HTML + markdown summary from matrix rows, audits and bench rows."""

from __future__ import annotations

import re

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


def _cell(dtype, status="PASS", device="cpu", err=1e-4, tol=1e-3, **kw):
    return {"op": "experts", "dtype": dtype, "batch": 3, "status": status, "device": device, "case": "base",
            "max_rel_err": err, "mean_rel_err": err / 2, "tol_max_rel": tol, "tol_mean_rel": tol / 4,
            "ref_dt_max_rel": tol / 4, "ref_dt_mean_rel": tol / 16, "margin": err / tol,
            "tol_source": "torch reference in " + dtype, **kw}


class _Audit:
    def __init__(self, passed):
        self.passed = passed

    def to_markdown(self):
        return f"### Audit `k`: {'PASS' if self.passed else 'FAIL'}"


def test_verdict_counts_audits_and_skips():
    skip = [{"op": "experts", "dtype": "float32", "status": "SKIP", "reason": "out of scope"}]
    _, md = build_report("v", manifest={}, rows=skip, audits=[], perf_rows=[], env={}, command="c")
    assert "**Verdict: NOT RUN**" in md and "nothing was proven" in md
    _, md = build_report("v", manifest={}, rows=[_cell("float32")], audits=[_Audit(False)], perf_rows=[], env={},
                         command="c")
    assert "**Verdict: FAIL**" in md and "1 failing audits" in md
    _, md = build_report("v", manifest={}, rows=[_cell("float32")], audits=[_Audit(True)], perf_rows=[], env={},
                         command="c")
    assert "**Verdict: PASS**" in md and "audits: 1 PASS, 0 FAIL of 1" in md


def test_coverage_says_what_ran_and_whether_bf16_on_a_gpu_was_proven():
    cpu = [_cell("float32"), _cell("float16"), {"op": "experts", "dtype": "bfloat16", "status": "SKIP",
                                                "reason": "the interpreter computes bf16 arithmetic wrongly"}]
    _, md = build_report("v", manifest={}, rows=cpu, audits=[], perf_rows=[], env={"gpu": "none (CPU)"}, command="c")
    assert "| execution | CPU (Triton kernels under the interpreter) |" in md
    assert "| dtypes not run | bfloat16: the interpreter computes bf16 arithmetic wrongly |" in md
    assert "NOT run (no GPU)" in md and "| bf16 on a GPU | NOT proven by this run |" in md
    gpu = [_cell("bfloat16", device="cuda"), _cell("bfloat16", device="cuda", case="odd-dims b3",
                                                                   case_family="odd-dims")]
    _, md = build_report("v", manifest={}, rows=gpu, audits=[], perf_rows=[], env={"gpu": "NVIDIA H200"}, command="c")
    assert "| execution | compiled, on the GPU |" in md and "| bf16 on a GPU | proven: 2 cells pass |" in md
    assert "run on every GPU cell" in md and "| extra cases | odd-dims b3 |" in md
    assert "| case families | odd-dims |" in md


def test_tolerance_table_and_per_dtype_plots():
    rows = [_cell("float32", tol=6e-5, err=1e-7), _cell("bfloat16", tol=3e-2, err=4e-3),
            _cell("bfloat16", status="FAIL", tol=3e-2, err=5e-2)]
    page, md = build_report("v", manifest={}, rows=rows, audits=[], perf_rows=[], env={}, command="c")
    assert "## Tolerances" in md and "x the error of the torch reference computed in the dtype" in md
    assert "| experts | bfloat16 | 2 | 0.03..0.03 |" in md and "| torch reference in bfloat16 |" in md
    plots = re.findall(r'<img src="data:image/png;base64,[^"]+" alt="errors and tolerances, (\w+)">', page)
    assert plots == ["bfloat16", "float32"]


def test_a_report_is_stale_when_what_it_depends_on_changed(tmp_path):
    from megadecode.validate import staleness as S

    src = "megadecode/backends/fused/kernels/rmsnorm.py"
    h = S.inputs_hash((src,))
    assert len(h) == 16 and h == S.inputs_hash((src,)) and h != S.inputs_hash(("megadecode/backends/fused/kernels/kda.py",))
    _, md = build_report("v", manifest={}, rows=[_cell("float32")], audits=[], perf_rows=[], env={}, command="c",
                         coverage={"inputs hash": h})
    report = tmp_path / "v-h200.md"
    report.write_text(md)
    assert S.recorded_hash(md) == h and S.stale_reason((src,), report) is None
    report.write_text(md.replace(h, "0" * 16))
    assert "inputs changed" in S.stale_reason((src,), report)
    report.write_text("# an old report")
    assert "no inputs hash" in S.stale_reason((src,), report)
    assert S.stale_reason((src,), tmp_path / "absent.md") == "no report"
