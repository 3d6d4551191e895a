"""No compile or capture inside a timed or served step (issue 16, item 3). On the CPU the graph executors run
eagerly, so a stand-in keeps the graph executor's bookkeeping (one graph per key, captured on first use) with
'graphs' that replay their step eagerly, and counts the captures: Engine.generate captures every graph its
decode steps replay before it starts timing, and a server captures every (batch size, length) it can meet at
startup, then none while requests of any length join and leave."""

from __future__ import annotations

import json

import pytest
import torch

from megadecode.engine import Engine
from megadecode.backends.graph.executor import KV_BUCKET, GraphExecutor
from megadecode.runner import ModelRunner
from megadecode.sampling import SamplingParams
from megadecode.scheduler import Scheduler
from megadecode.sequence import Sequence
from megadecode.serve.loop import EngineLoop, NullMetrics
from megadecode.step import Step

QWEN = "tiny-qwen3-moe"
GREEDY = SamplingParams(greedy=True)


class CountingGraphExecutor(GraphExecutor):
    """GraphExecutor with use_graphs on and a capture that records its key and returns a graph whose replay runs
    the captured (static) step eagerly."""

    def __init__(self, *a):
        super().__init__(*a)
        self.use_graphs = True
        self.captures: list[tuple[int, int, bool]] = []

    def _capture(self, step: Step, kv_len: int):
        B = step.num_tokens
        static = Step(tokens=step.tokens.clone(), positions=step.positions.clone(), slots=step.slots.clone(),
                      logit_rows=torch.arange(B), kv_len=kv_len, contiguous_slots=step.contiguous_slots)
        logits = torch.empty(B, self.cfg.vocab_size)
        self.captures.append((B, kv_len, step.contiguous_slots))
        run = self._flagged_step

        class Graph:
            def replay(self):
                logits.copy_(run(static))

        return Graph(), static, logits, ()


class LengthFreeCounting(CountingGraphExecutor):
    def length_free(self, batch: int) -> bool:  # as the fused executor with its attention kernels in scope
        return True


def counting_engine(max_batch: int, max_seq_len: int, cls=CountingGraphExecutor) -> Engine:
    eng = Engine.from_pretrained(QWEN, executor="graph", max_batch=max_batch, max_seq_len=max_seq_len)
    eng.executor = cls(eng.plan, eng.executor.weights, eng.cache)
    return eng


def test_graph_lengths():
    ex = counting_engine(2, 500).executor
    assert KV_BUCKET == 256
    assert ex.graph_lengths(1, 1, 1) == [256]
    assert ex.graph_lengths(1, 251, 269) == [256, 500]
    assert ex.graph_lengths(3, 1, 500) == [256, 500]  # the last bucket is the cache's length
    assert ex.graph_lengths(3, 300, 400) == [500]
    assert LengthFreeCounting(ex.plan, ex.weights, ex.cache).graph_lengths(3, 1, 500) == [500]
    eager = Engine.from_pretrained(QWEN, executor="graph", max_batch=1, max_seq_len=8).executor
    assert eager.graph_lengths(1, 1, 8) == []  # no CUDA: the graph executor runs eagerly


def test_generate_captures_before_timing():
    """A generation that crosses a cache-length bucket (positions 250 -> 270) used to capture the second graph
    inside the timed decode loop (issue 16: 187 tokens/s for 1000 tokens on the H200, a capture every 256
    positions). Now both are captured first, counted in warmup_s, and the loop captures nothing."""
    eng = counting_engine(1, 300)
    ex = eng.executor
    prompt = [[256] + [7] * 249]
    timed = []
    real_decode = eng.decode

    def decode(tokens):
        before = len(ex.captures)
        out = real_decode(tokens)
        timed.append(len(ex.captures) - before)
        return out

    eng.decode = decode
    res = eng.generate(prompt, 21, GREEDY, stop_at_eos=False)
    assert ex.captures == [(1, 256, True), (1, 300, True)]
    assert res.warmup_steps == 2 and res.warmup_s > 0 and len(timed) == 20 and sum(timed) == 0
    again = eng.generate(prompt, 21, GREEDY, stop_at_eos=False)  # already captured: nothing more
    assert len(ex.captures) == 2 and again.token_ids == res.token_ids
    ref = Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=300).generate(prompt, 21, GREEDY, stop_at_eos=False)
    assert res.token_ids == ref.token_ids  # the bucketed steps compute the same tokens
    assert ref.warmup_steps == 0  # the torch executor has nothing to capture


@pytest.mark.parametrize("cls, graphs", [(CountingGraphExecutor, 3 * 2), (LengthFreeCounting, 3)])
def test_serving_captures_only_at_startup(cls, graphs):
    """Max batch 4, sizes 1, 2, 4 prepared; context 300 (buckets 256 and 300). Sequences of 1 to 4 at once, at
    positions on both sides of 256: no capture after warm-up, and only prepared batch sizes are captured."""
    eng = counting_engine(5, 300, cls)
    runner = ModelRunner(eng, [1, 2, 4])
    assert runner.pad
    assert runner.warmup() == graphs
    assert sorted({b for b, _, _ in eng.executor.captures}) == [1, 2, 4]
    assert all(not contiguous for _, _, contiguous in eng.executor.captures)  # served slots are any slots
    at_startup = list(eng.executor.captures)
    got = {}
    loop = EngineLoop(runner, Scheduler(4, 100), lambda items: [got.setdefault(s.id, []).append(d.token)
                                                                for s, d in items if d.token is not None])
    seqs = [Sequence(prompt=[256] + [5 + i] * n, max_tokens=m)
            for i, (n, m) in enumerate([(240, 30), (3, 12), (250, 20), (10, 5), (100, 9)])]
    for k, s in enumerate(seqs):
        loop.submit(s)
        loop.iteration()
        if k % 2:
            loop.iteration()
    while loop.iteration():
        pass
    assert eng.executor.captures == at_startup
    ref = Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=300)
    for s in seqs:
        assert got[s.id] == ref.generate([s.prompt], s.max_tokens, GREEDY, stop_at_eos=False).token_ids[0]


def test_generate_json_reports_warmup(capsys):
    from megadecode.cli import main

    assert main(["generate", "--model", QWEN, "--greedy", "--json", "--max-new-tokens", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["warmup_s"] >= 0 and doc["decode_s"] > 0


def test_speculative_serving_captures_only_at_startup():
    """With prompt-lookup drafts, a verify step feeds each sequence 1 to 4 tokens: its row count, padded with
    scratch-slot rows to one of ModelRunner.verify_sizes, was captured at startup, so drafts never capture
    mid-stream (before the padding, every new row count did); the served tokens are the greedy ones alone."""
    from megadecode.speculative import NgramDrafter

    eng = counting_engine(5, 300, LengthFreeCounting)
    runner = ModelRunner(eng, [1, 2, 4])
    drafter = NgramDrafter(3)
    assert runner.warmup(drafter=drafter) == 3 + 5  # decode 1, 2, 4; verify 1, 2, 4, 8, 16 (causal rows)
    assert sorted(b for b, _, _ in eng.executor.captures) == [1, 2, 4, 8, 16]  # graph keys ignore causal rows
    at_startup = list(eng.executor.captures)
    got, drafted = {}, []

    class Metrics(NullMetrics):
        def speculated(self, n: int, accepted: int) -> None:
            drafted.append(n)

    loop = EngineLoop(runner, Scheduler(4, 100), lambda items: [got.setdefault(s.id, []).append(d.token)
                                                                for s, d in items if d.token is not None],
                      Metrics(), drafter=drafter)
    seqs = [Sequence(prompt=[256] + [5 + i, 9, 11] * n, max_tokens=m)
            for i, (n, m) in enumerate([(6, 14), (1, 9), (4, 12), (2, 5), (5, 10)])]
    for k, s in enumerate(seqs):
        loop.submit(s)
        loop.iteration()
        if k % 2:
            loop.iteration()
    while loop.iteration():
        pass
    assert eng.executor.captures == at_startup
    assert sum(drafted) > 0  # the steps verified drafts
    ref = Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=300)
    for s in seqs:
        assert got[s.id] == ref.generate([s.prompt], s.max_tokens, GREEDY, stop_at_eos=False).token_ids[0]
