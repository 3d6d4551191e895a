"""bench/ab_gate.py on stand-in A/B results: a variant lands only when every check passed, it is the asked
fraction faster at the named batches and within the slack at the held ones; a batch without both variants' times
is an error, not a pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_gate  # noqa: E402  (bench/)


def _doc(times: dict, failures=()):
    return {"checks": [{"variant": "v", "batch": 17, "failures": list(failures)}],
            "runs": [{"preset": "p", "batch": b, "median_us": {"shipped": s, "v": v}} for b, (s, v) in times.items()]}


def test_gate_lands_only_a_checked_faster_variant(tmp_path, capsys):
    times = {64: (100.0, 95.0), 17: (100.0, 97.0), 8: (100.0, 100.4)}
    assert ab_gate.verdict(_doc(times), "v", "shipped", 2, [64, 17], 0.5, [8])[0]
    ok, lines = ab_gate.verdict(_doc(times), "v", "shipped", 4, [64, 17], 0.5, [8])
    assert not ok and any(ln.startswith("batch 17") and "NOT" in ln for ln in lines)
    assert not ab_gate.verdict(_doc(times), "v", "shipped", 2, [64], 0.3, [8])[0]  # 0.4% over at 8
    assert not ab_gate.verdict(_doc(times, ["out: 1 buffer differs"]), "v", "shipped", 2, [64], 0.5, [])[0]
    assert not ab_gate.verdict({"checks": [], "runs": _doc(times)["runs"]}, "v", "shipped", 2, [64], 0.5, [])[0]
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(_doc(times)))
    assert ab_gate.main([str(path), "--variant", "v", "--faster", "2", "--batches", "64,17", "--hold", "8"]) == 0
    assert "v: lands" in capsys.readouterr().out
    assert ab_gate.main([str(path), "--variant", "v", "--batches", "1"]) == 2
    assert "no run at batch 1" in capsys.readouterr().err
