"""Tuned launch parameters (megadecode/backends/fused/kernels/tuning.py), their use by fused_experts, and `megadecode tune`
(megadecode/tune.py) where it can run without a GPU: argument handling and the no-CUDA exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
_saved = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:  # as tests/test_fused_experts.py: never decorate the kernels for a GPU on the CPU
    os.environ["TRITON_INTERPRET"] = "1"
from megadecode.backends.fused.kernels import fused_experts as FE  # noqa: E402

if _saved is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _saved

from megadecode import tune  # noqa: E402
from megadecode.cli import main  # noqa: E402
from megadecode.backends.fused.kernels import tuning  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from interp import Recorder  # noqa: E402  (tests/)

KEY = "D=64,I=32,A=2,wdtype=fp32,act=silu"
CFG = {"BLOCK_I": 16, "BLOCK_D": 32, "BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2}


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """CONFIG_DIR redirected to a temporary directory, with a clean cache before and after."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.clear_cache()
    yield tmp_path
    tuning.clear_cache()


def _write(batches: dict, device="Fake GPU 80GB") -> None:
    data = None
    for b, cfg in batches.items():
        data = tuning.merge(data, FE.KERNEL, device, KEY, b, cfg, {"ms": 1.0, "mbu": 0.5, "command": "t",
                                                                   "date": "d"})
    tuning.write(tuning.config_path(FE.KERNEL, device), data)


def test_config_path(configs):
    assert tuning.config_path("fused-experts", "NVIDIA H200") == configs / "fused-experts" / "nvidia-h200.json"


def test_json_round_trip(configs):
    _write({1: CFG, 8: {**CFG, "BLOCK_N": 32}})
    path = tuning.config_path(FE.KERNEL, "Fake GPU 80GB")
    data = json.loads(path.read_text())
    assert data["kernel"] == "fused-experts" and data["device"] == "Fake GPU 80GB"
    assert data["shapes"] == {KEY: {"1": CFG, "8": {**CFG, "BLOCK_N": 32}}}
    assert data["measured"][KEY]["8"] == {"ms": 1.0, "mbu": 0.5, "command": "t", "date": "d"}
    assert tuning.read(path) == data
    # merging keeps the other shapes and batches
    merged = tuning.merge(data, FE.KERNEL, "Fake GPU 80GB", "other", 4, CFG, {})
    assert set(merged["shapes"]) == {KEY, "other"} and set(merged["shapes"][KEY]) == {"1", "8"}


def test_lookup_rules(configs):
    _write({2: {**CFG, "BLOCK_N": 2}, 8: {**CFG, "BLOCK_N": 8}})
    look = lambda b: tuning.lookup(FE.KERNEL, "Fake GPU 80GB", KEY, b)  # noqa: E731
    assert look(2)["BLOCK_N"] == 2  # exact
    assert look(1)["BLOCK_N"] == 2  # the next larger tuned batch
    assert look(3)["BLOCK_N"] == 8
    assert look(16)["BLOCK_N"] == 8  # above the largest: the largest
    assert tuning.lookup(FE.KERNEL, "Fake GPU 80GB", "D=1,I=1,A=1,wdtype=fp32,act=silu", 1) is None
    assert tuning.lookup(FE.KERNEL, "Other GPU", KEY, 1) is None


def test_lookup_is_cached(configs):
    _write({1: CFG})
    assert tuning.lookup(FE.KERNEL, "Fake GPU 80GB", KEY, 1) == CFG
    tuning.config_path(FE.KERNEL, "Fake GPU 80GB").unlink()
    assert tuning.lookup(FE.KERNEL, "Fake GPU 80GB", KEY, 1) == CFG  # read once per process


@pytest.mark.parametrize("text, why", [
    ("{not json", "Expecting"),
    ('{"kernel": "fused-experts", "device": "x"}', '"shapes"'),
    ('{"kernel": "fused-experts", "device": "x", "shapes": {"k": {"one": {}}}}', "not a positive integer"),
    ('{"kernel": "fused-experts", "device": "x", "shapes": {"k": {"1": {"BLOCK_I": "32"}}}}', "integer"),
])
def test_malformed_file_names_it(configs, text, why):
    path = tuning.config_path(FE.KERNEL, "Fake GPU 80GB")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ValueError, match="malformed tuning file") as e:
        tuning.lookup(FE.KERNEL, "Fake GPU 80GB", KEY, 1)
    assert str(path) in str(e.value) and why in str(e.value)


def _launch(monkeypatch, device_name, blocks=None):
    up, down = Recorder(), Recorder()
    monkeypatch.setattr(FE, "experts_up_kernel", up)
    monkeypatch.setattr(FE, "experts_down_kernel", down)
    monkeypatch.setattr(FE, "_device_name", lambda device: device_name)
    T, A, E, D, I = 3, 2, 4, 64, 32
    x, ids, w = torch.randn(T, D), torch.zeros(T, A, dtype=torch.long), torch.ones(T, A)
    FE.fused_experts(x, ids, w, torch.randn(E, 2 * I, D), torch.randn(E, D, I), blocks=blocks)
    (_, kw_up), = up.launches
    (grid, kw_dn), = down.launches
    return kw_up, kw_dn, grid


def test_fused_experts_uses_the_tuned_config(configs, monkeypatch):
    _write({4: CFG})  # batch 3 -> the entry of batch 4
    kw_up, kw_dn, grid = _launch(monkeypatch, "Fake GPU 80GB")
    assert (kw_up["BLOCK_I"], kw_up["BLOCK_D"], kw_up["num_warps"], kw_up["num_stages"]) == (16, 32, 2, 2)
    assert (kw_dn["BLOCK_N"], kw_dn["BLOCK_K"], kw_dn["num_warps"], kw_dn["num_stages"]) == (8, 32, 2, 2)
    assert grid == (3, 64 // 8)


def test_fused_experts_defaults_without_tuning_and_blocks_override(configs, monkeypatch):
    d = FE.DEFAULT_BLOCKS
    kw_up, kw_dn, _ = _launch(monkeypatch, None)  # not CUDA: no lookup
    assert (kw_up["BLOCK_I"], kw_dn["BLOCK_N"], kw_up["num_warps"]) == (d["BLOCK_I"], d["BLOCK_N"], d["num_warps"])
    _write({4: CFG})
    kw_up, kw_dn, _ = _launch(monkeypatch, "Fake GPU 80GB", blocks={"BLOCK_N": 32})  # explicit blocks win
    assert (kw_up["BLOCK_I"], kw_dn["BLOCK_N"]) == (d["BLOCK_I"], 32)


def test_shape_key_and_tune_shapes():
    assert FE.shape_key(3584, 3072, 16, "mxfp4", "situ") == "D=3584,I=3072,A=16,wdtype=mxfp4,act=situ"
    k3, qwen = preset_config("k3-layer"), preset_config("qwen3-30b-a3b")
    assert {k: tune.SHAPES["k3"][k] for k in "DIAE"} == {"D": k3.latent_size, "I": k3.moe_intermediate_size,
                                                        "A": k3.top_k, "E": k3.num_experts}
    assert tune.SHAPES["k3"]["act"] == k3.expert_act
    assert (tune.SHAPES["qwen3-30b-a3b"]["D"], tune.SHAPES["qwen3-30b-a3b"]["I"]) == \
        (qwen.hidden_size, qwen.moe_intermediate_size)
    grid = list(tune.candidates())
    assert FE.DEFAULT_BLOCKS in grid and set(grid[0]) == set(FE.DEFAULT_BLOCKS)


@pytest.mark.skipif(ON_GPU, reason="checks the no-CUDA path")
def test_tune_without_cuda_exits_2(capsys):
    assert main(["tune", "--kernel", "fused-experts", "--shape", "k3", "--batch", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadecode: error:") and "CUDA" in err and "Traceback" not in err


def test_cli_lists_tune():
    out = subprocess.run([sys.executable, "-m", "megadecode", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "tune" in out
    out = subprocess.run([sys.executable, "-m", "megadecode", "tune", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--kernel" in out and "--shape" in out and "--batch" in out


def test_shipped_tuning_files_are_measured():
    """Only a GPU run of `megadecode tune` writes tuning files; the repository ships none until one has."""
    shipped = sorted(p.relative_to(tuning.CONFIG_DIR) for p in tuning.CONFIG_DIR.rglob("*.json"))
    for p in shipped:  # any file present must be a tuner's output: every entry measured
        data = tuning.read(tuning.CONFIG_DIR / p)
        for shape, by_batch in data["shapes"].items():
            for b in by_batch:
                assert {"ms", "mbu", "command", "date"} <= set(data["measured"][shape][b]), (p, shape, b)


@pytest.mark.parametrize("args, why", [
    (["--kernel", "fp8-experts", "--shape", "qwen3-30b-a3b", "--weights", "bf16"], "FP8 weights are fp8-experts'"),
    (["--kernel", "grouped-experts", "--shape", "qwen3-30b-a3b", "--weights", "fp8"], "FP8 weights are fp8-experts'"),
    (["--kernel", "fp8-experts", "--shape", "k3"], "fp8-experts computes SwiGLU (silu)"),
])
def test_tune_refuses_a_weight_format_its_kernel_does_not_take(args, why, capsys):
    """Refused in one line before anything runs, on any machine (the CUDA check comes after)."""
    assert main(["tune", *args, "--batch", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadecode: error:") and why in err and "Traceback" not in err


def test_fp8_experts_sweep_names_only_its_launch_parameters():
    from megadecode.backends.fused.kernels import fp8_experts

    grid = list(tune.candidates(tune.GRIDS["fp8-experts"]))
    assert len(grid) == 36 and all(set(c) <= set(fp8_experts.DEFAULT_BLOCKS) for c in grid)
    assert all(128 % c["BLOCK_D"] == 0 for c in grid)  # a chunk inside one scale column of the 128 x 128 blocks
