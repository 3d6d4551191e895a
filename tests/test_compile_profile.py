"""bench/compile_profile.py: the whole compile, then each named body left out, each in a fresh process (the
compiles themselves are stubbed here: what is checked is which runs are made and how their seconds are read)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import compile_profile  # noqa: E402


def test_each_named_body_is_left_out_in_its_own_process(monkeypatch, tmp_path, capsys):
    runs = []

    def fake_run(cmd, **kw):
        runs.append(cmd[-1])
        secs = {"-": 60.0, "MATVEC": 30.0, "GLU": 40.0}[cmd[-1]]
        return types.SimpleNamespace(returncode=0, stdout=f"log line\n{secs}\n", stderr="")

    monkeypatch.setattr(compile_profile.subprocess, "run", fake_run)
    out = tmp_path / "p.json"
    assert compile_profile.main(["--bodies", "MATVEC,GLU", "--out", str(out)]) == 0
    assert runs == ["-", "MATVEC", "GLU"]
    assert json.loads(out.read_text()) == {"whole": 60.0, "without MATVEC": 30.0, "without GLU": 40.0}
    assert "without GLU" in capsys.readouterr().out


def test_a_failed_compile_or_an_unknown_body_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(compile_profile.subprocess, "run",
                        lambda cmd, **kw: types.SimpleNamespace(returncode=1, stdout="", stderr="boom"))
    assert compile_profile.main(["--bodies", "GLU"]) == 1
    assert "boom" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compile_profile.main(["--bodies", "NOPE"])
    assert "no body ['NOPE']" in capsys.readouterr().err
