"""bench/ptx_identity.py's comparison (the builds are stand-ins here; the real ones compile for minutes): a build
whose PTX changed is named and fails the run, a changed comment line does not count, a build missing on either
side counts as changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ptx_identity  # noqa: E402  (bench/)


def test_ptx_identity_names_what_changed(monkeypatch, tmp_path, capsys):
    before = tmp_path / "before.json"
    monkeypatch.setattr(ptx_identity, "builds", lambda: [("a", lambda: "// cuda 13.0\nadd.f32 x;"),
                                                         ("b", lambda: "mul.f32 y;")])
    assert ptx_identity.main(["--out", str(before)]) == 0
    assert set(json.loads(before.read_text())) == {"a", "b"}

    monkeypatch.setattr(ptx_identity, "builds", lambda: [("a", lambda: "// cuda 13.1\nadd.f32 x;"),
                                                         ("b", lambda: "mul.f32 y;")])
    assert ptx_identity.main(["--against", str(before)]) == 0
    assert "2 of 2 builds have the PTX" in capsys.readouterr().out

    monkeypatch.setattr(ptx_identity, "builds", lambda: [("a", lambda: "add.f32 x;"), ("b", lambda: "fma.f32 y;"),
                                                         ("c", lambda: "")])
    assert ptx_identity.main(["--against", str(before)]) == 1
    err = capsys.readouterr().err
    assert "differs: b" in err and "differs: c" in err and "differs: a" not in err
