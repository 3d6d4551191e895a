"""Continuous batching on the GPU (skipped without CUDA): the engine loop with captured executors (`graph`, `fused`),
padded batches and overlapped steps, fp32. Every sequence gets exactly the greedy tokens the torch executor gives it
alone, and no graph is captured after startup (`graph`: every 256-position bucket prepared; `fused`: one graph per
batch size, whatever the length)."""

from __future__ import annotations

import pytest
import torch

from megadecode import Engine, SamplingParams
from megadecode.presets import preset_config
from megadecode.runner import ModelRunner
from megadecode.scheduler import Scheduler
from megadecode.sequence import Sequence
from megadecode.serve.loop import EngineLoop
from megadecode.weights import random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_SEQ = 300  # buckets 256 and 300 for `graph`
GREEDY = SamplingParams(greedy=True)


def graphs(executor) -> int:
    return len(getattr(executor, "_graphs", {}))


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("executor", ["graph", "fused"])
def test_served_tokens_and_no_capture_after_startup(preset, executor):
    if executor == "fused":
        pytest.importorskip("triton")
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.float32, seed=1)
    eng = Engine(cfg, w, executor=executor, max_batch=5, max_seq_len=MAX_SEQ)  # 4 slots + scratch
    runner = ModelRunner(eng, [1, 2, 4])
    assert runner.pad
    n = runner.warmup()
    assert n == graphs(eng.executor) == (3 * 2 if executor == "graph" else 3)
    got = {}
    loop = EngineLoop(runner, Scheduler(4, 100), lambda items: [got.setdefault(s.id, []).append(d.token)
                                                                for s, d in items if d.token is not None])
    seqs = [Sequence(prompt=[256] + [5 + i] * k, max_tokens=m)
            for i, (k, m) in enumerate([(240, 30), (3, 12), (250, 20), (10, 5), (100, 9), (1, 40)])]
    for k, s in enumerate(seqs):
        loop.submit(s)
        loop.iteration()
    while loop.iteration():
        pass
    assert graphs(eng.executor) == n, "a graph was captured while serving"
    ref = Engine(cfg, w, executor="torch", max_batch=1, max_seq_len=MAX_SEQ)
    for s in seqs:
        assert got[s.id] == ref.generate([s.prompt], s.max_tokens, GREEDY, stop_at_eos=False).token_ids[0], s.id


def test_generate_captures_before_its_timed_loop():
    """positions 250 -> 270 cross a bucket: both graphs are captured in the warm-up, none in the timed loop."""
    cfg = preset_config("tiny-qwen3-moe")
    eng = Engine(cfg, random_weights(cfg, "cuda", torch.float32, seed=1), executor="graph", max_batch=1,
                 max_seq_len=MAX_SEQ)
    res = eng.generate([[256] + [7] * 249], 21, GREEDY, stop_at_eos=False)
    assert res.warmup_steps == 2 == graphs(eng.executor) and res.warmup_s > 0
