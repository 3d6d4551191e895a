"""`--executor auto` (backends/auto.py): the pick from the committed table of measured step times, and the table
itself held to a recomputation from bench/results (bench/auto_picks.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megadecode.backends import auto
from megadecode.presets import preset_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def test_the_committed_table_is_the_recomputation_of_the_results():
    import auto_picks

    committed = json.loads(auto_picks.OUT.read_text())
    assert committed == auto_picks.table(auto_picks.rows())
    q = committed["families"]["qwen3_moe"]["batches"]
    assert [c["executor"] for c in q["1"]][:2] == ["fused", "mega"]  # fused 4.21 ms, mega 4.54 (d581af0)
    assert all(c["from"].startswith("bench/results/") for cs in q.values() for c in cs)


def test_on_the_cpu_auto_is_the_reference():
    name, why = auto.choose(preset_config("tiny-qwen3-moe"), "cpu", torch.float32, 1)
    assert name == "torch" and why.startswith("auto -> torch")


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


def test_on_the_h200_the_fastest_measured_that_can_run(h200, monkeypatch):
    table = auto.table_for("NVIDIA H200")
    q1 = table["families"]["qwen3_moe"]["batches"]["1"]
    cfg = preset_config("tiny-qwen3-moe")
    name, why = auto.choose(cfg, "cuda", torch.bfloat16, 1)
    assert name == q1[0]["executor"] and "fastest for qwen3_moe at batch 1" in why
    assert f"{q1[1]['executor']} {q1[1]['ms']:.2f}" in why and q1[0]["from"] in why  # the others, and the source
    assert auto.choose(cfg, "cuda", torch.bfloat16, 3)[1].count("at batch 2") == 1  # nearest measured at or below
    # an executor that cannot run here is skipped, and said so: mega first at kimi_k3's batch 2 (a table where it
    # was measured fastest) runs bf16 weights only, and needs CUTLASS's DSL
    k3 = preset_config("tiny-k3")
    fam = table["families"]["kimi_k3"]["batches"]
    rows = {c["executor"]: c for c in fam["2"]}
    fake = {**table, "families": {**table["families"], "kimi_k3": {**table["families"]["kimi_k3"], "batches": {
        **fam, "2": [rows["mega"], *(c for c in fam["2"] if c["executor"] != "mega")]}}}}
    monkeypatch.setattr(auto, "table_for", lambda gpu: fake)
    name, why = auto.choose(k3, "cuda", torch.bfloat16, 2)
    assert name == ("mega" if importlib.util.find_spec("cutlass") else "fused")
    name, why = auto.choose(k3, "cuda", torch.float32, 2)
    assert name == "fused" and "mega skipped: it runs bf16 weights" in why


def test_a_family_or_gpu_without_a_table_takes_fused(h200, monkeypatch):
    name, why = auto.choose(preset_config("tiny-kimi-linear"), "cuda", torch.bfloat16, 1)
    assert name == "fused" and "no measured table for kimi_linear" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    name, why = auto.choose(preset_config("tiny-qwen3-moe"), "cuda", torch.bfloat16, 1)
    assert name == "fused" and "no measured table for NVIDIA B200" in why


def test_generate_names_its_pick_on_a_gpu_only(capsys, h200, monkeypatch):
    from megadecode.backends.auto import resolve_executor
    from megadecode.cli import main

    assert main(["generate", "--max-new-tokens", "2"]) == 0  # the CPU: torch, nothing said (errors stay one line)
    assert "auto" not in capsys.readouterr().err
    args = type("A", (), {"executor": "auto", "device": "cuda", "dtype": "bfloat16"})()
    resolve_executor(args, preset_config("tiny-qwen3-moe"), 1, True)
    assert args.executor == "fused" and "megadecode: auto -> fused: fastest for qwen3_moe" in capsys.readouterr().err
