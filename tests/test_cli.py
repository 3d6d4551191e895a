"""The `megadecode` command line (cli.py) and the benchmark's byte accounting (bench.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from megadecode import bench
from megadecode.cli import main
from megadecode.presets import preset_config

GEN = ["generate", "--model", "tiny-qwen3-moe", "--greedy", "--json", "--max-new-tokens", "5"]


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # stdout holds exactly one JSON object


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "megadecode", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for cmd in ("generate", "make-checkpoint", "bench"):
        assert cmd in out


def test_generate_json_token_ids_deterministic(capsys):
    argv = GEN + ["--token-ids", "256,1,2", "--token-ids", "256,7"]
    a = run_json(capsys, argv)
    assert set(a) == {"model", "executor", "device", "dtype", "token_ids", "logprobs", "text", "prefill_s",
                      "decode_s", "decode_tokens_per_s"}
    assert len(a["token_ids"]) == len(a["logprobs"]) == len(a["text"]) == 2
    V = preset_config("tiny-qwen3-moe").vocab_size
    for ids, lps in zip(a["token_ids"], a["logprobs"]):
        assert len(ids) == len(lps)
        assert 1 <= len(ids) <= 5  # cut after EOS, if one came up
        assert len(ids) == 5 or ids[-1] == 257
        assert all(0 <= t < V for t in ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in lps)
    b = run_json(capsys, argv)
    assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


def test_generate_text_output(capsys):
    assert main(["generate", "--max-new-tokens", "3", "--prompt", "hi", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] 'hi' -> ") and "tokens/s" in out


def test_generate_bad_token_id(capsys):
    assert main(GEN + ["--token-ids", "256,99999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadecode: error:") and "99999" in err and "Traceback" not in err


def test_generate_unknown_model(capsys, tmp_path):
    assert main(GEN + ["--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "megadecode: error:" in err and "no-such-model" in err


def test_bad_sampling_is_user_error(capsys):
    assert main(["generate", "--temperature", "0", "--max-new-tokens", "2"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_make_checkpoint_then_generate(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny-deepseek-v3", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    assert (ckpt / "config.json").is_file()
    r = run_json(capsys, ["generate", "--model", str(ckpt), "--json", "--max-new-tokens", "3", "--check-finite"])
    assert r["model"] == str(ckpt)
    V = preset_config("tiny-deepseek-v3").vocab_size
    assert all(0 <= t < V for t in r["token_ids"][0]) and all(lp <= 0 for lp in r["logprobs"][0])


def test_make_checkpoint_unknown_preset(capsys, tmp_path):
    assert main(["make-checkpoint", "--preset", "no-such-preset", "--out", str(tmp_path / "x")]) == 2
    assert "no-such-preset" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_needs_cuda():
    p = subprocess.run([sys.executable, "-m", "megadecode", "bench", "--preset", "tiny-qwen3-moe"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert "megadecode: error:" in p.stderr and "CUDA" in p.stderr and "Traceback" not in p.stderr


def test_step_bytes_by_hand():
    cfg = preset_config("tiny-qwen3-moe")  # D 64, 3 layers (layer 1 dense), GQA 4 q / 2 kv heads of 16
    D, V, I, Idense, E, hd = 64, 259, 32, 96, 8, 16
    attn = 4 * hd * D + 2 * (2 * hd * D) + D * 4 * hd + 2 * hd  # q, k, v, o, q/k norms
    norms = 2 * D
    trunk = (3 * (attn + norms) + 3 * D * Idense + 2 * E * D + D) * 2  # + dense MLP, routers, final norm
    expert, lm_head = 3 * D * I * 2, V * D * 2
    cache_per_token = 3 * 2 * 2 * hd * 2  # layers x (k, v) x kv heads x head_dim x bf16
    got = bench.step_bytes(cfg, [5, 7], batch=4, context=100, cache_bytes_per_token=cache_per_token,
                           dtype_bytes=2)
    assert got == trunk + 12 * expert + lm_head + 4 * 100 * cache_per_token
    # recurrent (KDA) state is read once per sequence per step
    with_state = bench.step_bytes(cfg, [5, 7], batch=4, context=100, cache_bytes_per_token=cache_per_token,
                                  dtype_bytes=2, state_bytes_per_sequence=1000)
    assert with_state == got + 4 * 1000


def test_kimi_linear_cache_reports_its_state_bytes():
    from megadecode.cache import KVCache

    cfg = preset_config("tiny-kimi-linear")
    cache = KVCache(cfg, num_slots=2, max_len=16, device="cpu", dtype=torch.float32)
    per_seq = sum(t[0].numel() * t.element_size() for n in cache.state_layers for t in cache[n])
    assert per_seq > 0 and cache.state_bytes_per_sequence() == per_seq


def test_bench_helpers():
    assert str(bench.default_out("qwen3-30b-a3b", "NVIDIA H200")) == "bench/results/qwen3-30b-a3b-nvidia-h200.json"
    rows = [{"preset": "p", "executor": "torch", "batch": 1, "context": 8, "ms_per_step": 1.0,
             "tokens_per_s": 1000.0, "bytes_per_step": 2e9, "floor_ms": 0.5, "mbu": 0.5},
            {"preset": "p", "executor": "graph", "batch": 64, "context": 8, "error": "OutOfMemoryError: x"}]
    table = bench.format_table(rows)
    assert "50.0%" in table and "OutOfMemoryError" in table


def test_distinct_experts_counts_moe_layers():
    from megadecode.engine import Engine
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-qwen3-moe")
    eng = Engine(cfg, random_weights(cfg), max_batch=4, max_seq_len=16)
    eng.lengths = [3] * 4
    counts = bench.distinct_experts(eng, torch.tensor([1, 2, 3, 4]))
    assert len(counts) == sum(cfg.moe_layers)
    assert all(cfg.top_k <= c <= min(cfg.num_experts, 4 * cfg.top_k) for c in counts)
    assert eng.lengths == [3] * 4  # the counting step does not advance the sequences
