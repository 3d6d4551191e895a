"""The ordering audit over the handoff kernel's planted mistakes, CPU part: the static audit flags every
mistake it can see and nothing in the correct kernel; the one it cannot see (a coherent load placed
above its wait) is left to the GPU's dynamic audit and reported as SKIP here, never as PASS."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from megadecode.validate.ordering import HANDOFF_VARIANTS, kernel_audits, run_ordering  # noqa: E402


@pytest.fixture(scope="module")
def cpu_rows():
    rows, reports = run_ordering(gpu=False)
    return rows, reports


def test_correct_handoff_is_clean_and_static_catches_four(cpu_rows):
    rows, _ = cpu_rows
    verdict = {r["variant"]: r for r in rows if r["check"] == "verdict"}
    assert set(verdict) == set(HANDOFF_VARIANTS)
    assert verdict["handoff"]["status"] == "PASS"
    for name in ("broken-handoff-hoist-nc", "broken-handoff-no-acquire", "broken-handoff-relaxed-signal",
                 "broken-handoff-signal-before-store"):
        assert verdict[name]["status"] == "PASS" and "static-audit" in verdict[name]["caught_by"], name
    lbw = verdict["broken-handoff-load-before-wait"]
    assert lbw["status"] == "SKIP" and "GPU" in lbw["reason"]


def test_static_findings_name_the_rule(cpu_rows):
    rows, _ = cpu_rows
    static = {r["variant"]: r for r in rows if r["check"] == "static-audit"}
    assert "nc-load-of-produced" in static["broken-handoff-hoist-nc"]["findings"]
    assert "wait-without-acquire" in static["broken-handoff-no-acquire"]["findings"]
    assert "signal-without-release" in static["broken-handoff-relaxed-signal"]["findings"]
    assert static["handoff"]["findings"] is None


def test_kernel_audits_come_from_the_declaration_not_the_name():
    """kernel_audits(name) audits what the variant declares (Manifest.kernels): the router's six routing forms and
    its logits' projection; every shipped variant: tests/test_harness_contract.py."""
    reports = kernel_audits("triton-router")
    assert [r.kernel for r in reports] == ["router_kernel"] * 6 + ["linear_kernel"]
    assert all(r.passed for r in reports), [r.to_markdown() for r in reports]


def test_cli_exit_status_follows_the_verdicts(cpu_rows, capsys):
    """The planted bugs' own checks fail by design; the command fails only when a subject is judged wrongly."""
    from megadecode.cli import main

    assert main(["validate", "--ordering"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["FAIL", "broken-handoff-hoist-nc", "static-audit"] in [ws[:3] for ws in lines]
    assert ["PASS", "broken-handoff-hoist-nc", "verdict"] in [ws[:3] for ws in lines]
