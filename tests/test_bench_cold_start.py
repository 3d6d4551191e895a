"""`megadecode bench` rows report the cold start (issue 13, item 7): the engine's construction and its first decode
step, wall clock, and whether this process built that executor before (kernel compiles are cached per process);
and the peak GPU memory allocated. The timing itself needs a GPU; here the engine and the timed loop are
stand-ins, so what is checked is that the row carries the measured parts and adds them up, and the
first-in-process flag per executor."""

from __future__ import annotations

import types

import pytest
import torch

from megadecode import bench
from megadecode.presets import preset_config


def test_bench_rows_carry_the_cold_start_and_first_in_process(monkeypatch):
    cfg = preset_config("tiny-qwen3-moe")
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 12.5e9)
    monkeypatch.setattr(bench, "_BUILT", set())
    cache = types.SimpleNamespace(bytes_per_token=lambda: 10, state_bytes_per_sequence=lambda: 0)
    monkeypatch.setattr(bench, "Engine", lambda *a, **k: types.SimpleNamespace(cache=cache, dtype=torch.bfloat16))
    monkeypatch.setattr(bench, "time_decode", lambda *a: (2.0, [3, 3], 7.5))
    args = types.SimpleNamespace(context=8, warmup=1, steps=2, seed=0, tokens="random")
    first = bench.bench_one(cfg, {}, "tiny-qwen3-moe", "mega", 1, args)
    again = bench.bench_one(cfg, {}, "tiny-qwen3-moe", "mega", 2, args)
    other = bench.bench_one(cfg, {}, "tiny-qwen3-moe", "fused", 1, args)
    assert first["engine_build_s"] == 1.0 and first["first_step_s"] == 7.5 and first["cold_start_s"] == 8.5
    assert first["first_in_process"] and not again["first_in_process"] and other["first_in_process"]
    assert first["ms_per_step"] == 2.0 and first["peak_alloc_gb"] == 12.5
    assert first["tokens"] == "random"



def test_bench_feeds_greedy_or_fresh_random_tokens():
    """`--tokens`: greedy (each step the last one's argmax, the default) or random (rows drawn before the timed
    loop); the row says which."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    drawn = torch.tensor([[7, 8], [9, 10]])
    assert torch.equal(bench.next_tokens("greedy", logits, None, 0), torch.tensor([1, 0]))
    assert torch.equal(bench.next_tokens("random", logits, drawn, 1), torch.tensor([9, 10]))
    with pytest.raises(ValueError, match="greedy or random"):
        bench.next_tokens("sampled", logits, drawn, 0)
