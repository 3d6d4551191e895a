"""Continuous batching without HTTP: the engine loop (serve/loop.py) driving the scheduler and the model runner
(megadecode/runner.py) step by step on tiny presets with the torch executor. Sequences join and leave between
steps in every order, padded or not, and each one gets exactly the tokens Engine.generate gives it alone; seeded
sampling is per request; a failing request fails alone."""

from __future__ import annotations

import functools
import itertools
import threading
import time

import pytest

from megadecode.engine import Engine
from megadecode.runner import ModelRunner, check_batch_sizes, default_batch_sizes
from megadecode.sampling import SamplingParams
from megadecode.scheduler import Scheduler
from megadecode.sequence import ABORT, ERROR, LENGTH, Sequence
from megadecode.serve.loop import EngineLoop

QWEN = "tiny-qwen3-moe"
MAX_SEQ = 32
PROMPTS = [[256, 72, 101], [256] + list(range(30, 38)), [256, 7]]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


@functools.lru_cache(maxsize=None)
def oracle_engine(preset: str) -> Engine:
    return Engine.from_pretrained(preset, max_batch=1, max_seq_len=MAX_SEQ)


@functools.lru_cache(maxsize=None)
def alone(preset: str, prompt: tuple, n: int, params: SamplingParams = SamplingParams(greedy=True), seed: int = 0):
    return oracle_engine(preset).generate([list(prompt)], n, params, seed=seed, stop_at_eos=False).token_ids[0]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(QWEN, max_batch=5, max_seq_len=MAX_SEQ)  # 4 slots + the scratch slot


class Collector:
    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, tuple] = {}

    def __call__(self, items):
        for seq, d in items:
            if d.token is not None:
                self.tokens.setdefault(seq.id, []).append(d.token)
            if d.finish_reason is not None:
                self.finish[seq.id] = (d.finish_reason, d.error)


def make_loop(engine, overlap: bool = True, **kw):
    runner = ModelRunner(engine, kw.pop("batch_sizes", None), kw.pop("pad", None))
    out = Collector()
    return EngineLoop(runner, Scheduler(runner.max_batch, 100), out, overlap=overlap), out


def orderings(n: int):
    """Every order of n joins and n leaves in which each sequence joins before it leaves (90 for n = 3)."""
    events = [(kind, i) for i in range(n) for kind in "JL"]
    for perm in itertools.permutations(events):
        if all(perm.index(("J", i)) < perm.index(("L", i)) for i in range(n)):
            yield perm


ORDERS = sorted(set(orderings(3)))


@pytest.mark.parametrize("mode", ["length, padded", "abort"])
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "".join(f"{k}{i}" for k, i in o))
def test_joins_and_leaves_in_every_order(engine, order, mode):
    """Event k of `order` happens at iteration k. A sequence that joins at iteration j has 2 tokens after it
    (its prefill's and the decode step's), one more per iteration; it leaves at iteration l either by
    max_tokens (its last token comes at l) or by an abort before iteration l. Steps are collected in the iteration
    that launched them (no overlap), so that the timeline is exact; the next test overlaps them."""
    padded = mode.startswith("length")
    loop, out = make_loop(engine, overlap=False, pad=padded, batch_sizes=[1, 4] if padded else None)
    when = {(k, i): t for t, (k, i) in enumerate(order)}
    seqs = []
    for i, p in enumerate(PROMPTS):
        j, l = when[("J", i)], when[("L", i)]
        seqs.append(Sequence(prompt=p, max_tokens=l - j + 2 if padded else MAX_SEQ - len(p)))
    for t in range(len(order)):
        for i, s in enumerate(seqs):
            if when[("J", i)] == t:
                loop.submit(s)
            if when[("L", i)] == t and not padded:
                loop.abort(s.id)
        loop.iteration()
        live = {i for i in range(3) if when[("J", i)] <= t < when[("L", i)] + (1 if padded else 0)}
        assert {s.id for s in loop.scheduler.running} == {seqs[i].id for i in live if not seqs[i].finished}
        slots = [s.slot for s in loop.scheduler.running]
        assert len(set(slots)) == len(slots) and loop.runner.scratch not in slots
    assert loop.iteration() is False  # everything left
    for i, s in enumerate(seqs):
        got = out.tokens[s.id]
        want = when[("L", i)] - when[("J", i)] + (2 if padded else 1)
        assert len(got) == want, (i, got)
        assert got == alone(QWEN, tuple(s.prompt), want), f"sequence {i}"
        assert s.finish_reason == (LENGTH if padded else ABORT)


@pytest.mark.parametrize("order", ORDERS[::3], ids=lambda o: "".join(f"{k}{i}" for k, i in o))
def test_overlapped_steps_in_many_orders(engine, order):
    """As above with the next decode step launched before the last one is collected (the server's way): a
    sequence that finished in the collected step has a row in the step in flight, dropped; every sequence gets
    exactly its tokens alone, and finishes by max_tokens, or by abort with a prefix of them."""
    loop, out = make_loop(engine, overlap=True, pad=True, batch_sizes=[1, 4])
    when = {(k, i): t for t, (k, i) in enumerate(order)}
    seqs = [Sequence(prompt=p, max_tokens=when[("L", i)] - when[("J", i)] + 2) for i, p in enumerate(PROMPTS)]
    aborted = seqs[1]  # leaves by abort at its L, the others by max_tokens
    aborted.max_tokens = MAX_SEQ - len(aborted.prompt)
    for t in range(len(order)):
        for i, s in enumerate(seqs):
            if when[("J", i)] == t:
                loop.submit(s)
            if when[("L", i)] == t and s is aborted:
                loop.abort(s.id)
        loop.iteration()
        slots = [s.slot for s in loop.scheduler.running]
        assert len(set(slots)) == len(slots)
    run_all(loop)
    assert loop._pending is None and loop.scheduler.idle()
    for i, s in enumerate(seqs):
        got = out.tokens[s.id]
        assert got == alone(QWEN, tuple(s.prompt), len(got)), f"sequence {i}"
        if s is aborted:
            assert s.finish_reason == ABORT and len(got) >= when[("L", i)] - when[("J", i)]
        else:
            assert s.finish_reason == LENGTH and len(got) == s.max_tokens


def test_seeded_sampling_is_per_request(engine):
    """Sampled requests, each with its own seed, joining a greedy one at different steps: each draws exactly
    what Engine.generate draws for it alone with that seed."""
    loop, out = make_loop(engine)
    n = 8
    greedy = Sequence(prompt=PROMPTS[0], max_tokens=n)
    a = Sequence(prompt=PROMPTS[1], max_tokens=n, params=SAMPLED, seed=11)
    b = Sequence(prompt=PROMPTS[2], max_tokens=n, params=SAMPLED, seed=12)
    c = Sequence(prompt=PROMPTS[2], max_tokens=n, params=SAMPLED, seed=13)
    loop.submit(greedy)
    loop.iteration()
    loop.submit(a), loop.submit(b)
    loop.iteration()
    loop.submit(c)
    while loop.iteration():
        pass
    assert out.tokens[greedy.id] == alone(QWEN, tuple(PROMPTS[0]), n)
    for s, seed in ((a, 11), (b, 12), (c, 13)):
        assert out.tokens[s.id] == alone(QWEN, tuple(s.prompt), n, SAMPLED, seed), seed
    assert out.tokens[b.id] != out.tokens[c.id]  # same prompt, other seed


def test_kda_model_padded():
    """kimi_linear's KDA state through the scratch slot: padding rows race on it, and it is zeroed before each
    padded step (poisoned here: the padding rows' logits stay finite); the real rows get their tokens."""
    preset = "tiny-kimi-linear"
    eng = Engine.from_pretrained(preset, max_batch=5, max_seq_len=MAX_SEQ)
    loop, out = make_loop(eng, pad=True, batch_sizes=[4])
    for name in eng.cache.state_layers:
        for t in eng.cache[name]:
            t[loop.runner.scratch] = float("nan")
    eng.executor.first_nonfinite.fill_(-1)
    seqs = [Sequence(prompt=p, max_tokens=5) for p in PROMPTS[:2]]
    loop.submit(seqs[0])
    loop.iteration()
    loop.submit(seqs[1])
    while loop.iteration():
        pass
    assert eng.executor.first_nonfinite.tolist() == [-1] * 5  # no row's logits held NaN, padding rows included
    for s in seqs:
        assert out.tokens[s.id] == alone(preset, tuple(s.prompt), 5)


def test_batch_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert check_batch_sizes([4, 2], 8) == [2, 4, 8]  # a full batch must have a size
    with pytest.raises(ValueError, match=r"in \[1, 8\]"):
        check_batch_sizes([0, 4], 8)


def test_runner_pads_to_the_prepared_sizes(engine):
    r = ModelRunner(engine, [1, 4], pad=True)
    assert [r.padded(b) for b in (1, 2, 3, 4)] == [1, 4, 4, 4]
    assert ModelRunner(engine).pad is False  # the torch executor runs eagerly: nothing to pad for
    assert r.scratch == 4 and r.max_batch == 4


def test_verify_steps_are_padded_to_sizes_warmed_at_startup(engine, monkeypatch):
    """Speculative decoding where decode steps replay captured graphs: each verify step is padded (rows of the
    scratch slot) to a row count the warm-up prepared with causal rows, so serving never captures mid-stream, and
    every sequence still gets exactly its greedy tokens alone. The torch executor runs eagerly; its graph lengths
    are faked so that the warm-up runs its steps."""
    from megadecode.speculative import NgramDrafter

    runner = ModelRunner(engine, [1, 2, 4], pad=True)
    drafter = NgramDrafter(3)
    sizes = runner.verify_sizes(drafter)
    assert sizes == [1, 2, 4, 8, 16] and runner.pads_verify(drafter)  # 4 sequences x (1 + 3 drafts) at most
    seen = []
    decode = engine.executor.decode

    def spy(step):
        seen.append((step.num_tokens, step.causal_rows, step.slots.tolist()))
        return decode(step)

    monkeypatch.setattr(engine.executor, "decode", spy)
    monkeypatch.setattr(engine.executor, "graph_lengths", lambda B, lo, hi: [MAX_SEQ])
    assert runner.warmup(drafter=drafter) == 3 + 5
    assert [(b, c) for b, c, _ in seen] == [(1, False), (2, False), (4, False)] + [(b, True) for b in sizes]
    assert all(set(sl) == {runner.scratch} for _, _, sl in seen)
    seen.clear()
    out = Collector()
    loop = EngineLoop(runner, Scheduler(runner.max_batch, 100), out, overlap=False, drafter=drafter)
    prompts = [[256] + [40, 41, 42] * 4, [256] + [50, 51] * 5, [256, 7], PROMPTS[1]]  # repetitive: drafts found
    seqs = [Sequence(prompt=p, max_tokens=12) for p in prompts]
    for q in seqs:
        loop.submit(q)
    run_all(loop)
    verify = [(b, sl) for b, c, sl in seen if c]
    assert verify and all(b in sizes for b, _ in verify)
    assert any(sl.count(runner.scratch) > 0 for _, sl in verify)  # some step was padded
    for q in seqs:
        assert out.tokens[q.id] == alone(QWEN, tuple(q.prompt), 12), q.prompt


def test_verify_steps_are_not_padded_where_decode_steps_are_not(engine):
    """Eager decode steps (no padding) run verify steps at their own row counts; a drafter that reads hidden states
    verifies through the prefill ops, never padded."""
    from megadecode.speculative import NgramDrafter

    assert not ModelRunner(engine).pads_verify(NgramDrafter(2))
    hidden = NgramDrafter(2)
    hidden.reads_hidden = True
    assert not ModelRunner(engine, [1, 4], pad=True).pads_verify(hidden)


# ---- failures stay with their request ---------------------------------------------------------------------------

def run_all(loop):
    while loop.iteration():
        pass


def test_nan_logits_fail_only_their_request():
    """A NaN in the embedding row of a token only one prompt holds: that request ends with an error naming the
    NaN, its slot is zeroed, and the other requests (in the same prefill and decode steps) get their tokens."""
    eng = Engine.from_pretrained(QWEN, max_batch=5, max_seq_len=MAX_SEQ)
    emb = eng.executor.weights["model.embed_tokens.weight"]
    bad_token = 200
    assert all(bad_token not in p for p in PROMPTS)
    emb[bad_token, 0] = float("nan")
    loop, out = make_loop(eng)
    good = [Sequence(prompt=p, max_tokens=6) for p in PROMPTS]
    bad = Sequence(prompt=[256, bad_token, 5], max_tokens=6)
    for s in (good[0], bad, good[1]):
        loop.submit(s)
    loop.iteration()
    assert bad.finish_reason == ERROR and "NaN or inf" in out.finish[bad.id][1]
    assert all(t[bad.slot].abs().sum() == 0 for t in eng.cache[f"cache.{0}"])  # zeroed for the next request
    loop.submit(good[2])  # takes the failed request's slot
    run_all(loop)
    for s in good:
        assert out.tokens[s.id] == alone(QWEN, tuple(s.prompt), 6)


def test_a_prefill_that_raises_fails_only_its_request(engine, monkeypatch):
    loop, out = make_loop(engine)
    real = engine.prefill_into

    def prefill_into(prompts, slots):
        if any(999 in p for p in prompts):
            raise RuntimeError("boom")
        return real(prompts, slots)

    monkeypatch.setattr(engine, "prefill_into", prefill_into)
    seqs = [Sequence(prompt=PROMPTS[0], max_tokens=4), Sequence(prompt=[256, 999], max_tokens=4),
            Sequence(prompt=PROMPTS[1], max_tokens=4)]
    for s in seqs:
        loop.submit(s)
    run_all(loop)
    assert out.finish[seqs[1].id][0] == ERROR and "boom" in out.finish[seqs[1].id][1]
    for s in (seqs[0], seqs[2]):
        assert out.tokens[s.id] == alone(QWEN, tuple(s.prompt), 4)


def test_a_decode_step_that_raises_fails_its_step_only(engine, monkeypatch):
    loop, out = make_loop(engine)
    first = Sequence(prompt=PROMPTS[0], max_tokens=4)
    loop.submit(first)
    real = loop.runner.launch_decode
    monkeypatch.setattr(loop.runner, "launch_decode", lambda *a: (_ for _ in ()).throw(RuntimeError("step broke")))
    loop.iteration()
    assert first.finish_reason == ERROR and "step broke" in out.finish[first.id][1]
    monkeypatch.setattr(loop.runner, "launch_decode", real)
    later = Sequence(prompt=PROMPTS[1], max_tokens=4)
    loop.submit(later)
    run_all(loop)
    assert out.tokens[later.id] == alone(QWEN, tuple(later.prompt), 4)
    assert loop.scheduler.free_slots == 4


def test_a_step_that_fails_when_collected_fails_its_sequences_only(engine, monkeypatch):
    """A CUDA error surfaces at the wait for a step's results: that step's sequences fail; the step launched
    after it (overlap) is collected and dropped; the next request is served."""
    loop, out = make_loop(engine)
    real, calls = loop.runner.collect, []

    def collect(step):
        calls.append(step)
        if len(calls) == 2:  # the first decode step (the first call is the prefill's)
            raise RuntimeError("device error")
        return real(step)

    monkeypatch.setattr(loop.runner, "collect", collect)
    first = Sequence(prompt=PROMPTS[0], max_tokens=6)
    loop.submit(first)
    run_all(loop)
    assert first.finish_reason == ERROR and "device error" in out.finish[first.id][1]
    assert len(out.tokens[first.id]) == 1  # the prefill's token
    later = Sequence(prompt=PROMPTS[1], max_tokens=4)
    loop.submit(later)
    run_all(loop)
    assert out.tokens[later.id] == alone(QWEN, tuple(later.prompt), 4) and loop.scheduler.free_slots == 4


def test_the_loop_thread_survives_its_own_errors(engine, monkeypatch):
    loop, out = make_loop(engine)
    real, calls = loop.iteration, []

    def iteration():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real()

    monkeypatch.setattr(loop, "iteration", iteration)
    loop.start()
    try:
        s = Sequence(prompt=PROMPTS[2], max_tokens=3)
        loop.submit(s)
        deadline = time.time() + 30
        while not s.finished and time.time() < deadline:
            time.sleep(0.01)
        assert loop.alive and "a bug" in loop.last_error
        assert out.tokens[s.id] == alone(QWEN, tuple(s.prompt), 3)
    finally:
        loop.stop()
    assert not loop.alive and not any(t.name == "megadecode-engine" and t.is_alive() for t in threading.enumerate())


def test_stopping_the_loop_fails_what_is_in_flight(engine):
    """No request waits forever on a loop that has stopped: each gets an error delta."""
    loop, out = make_loop(engine)
    seqs = [Sequence(prompt=p, max_tokens=MAX_SEQ - len(p)) for p in PROMPTS] + \
           [Sequence(prompt=PROMPTS[0], max_tokens=4) for _ in range(3)]  # 4 slots: 2 wait
    loop.start()
    for s in seqs:
        loop.submit(s)
    loop.stop()
    assert all(s.finished for s in seqs)
    assert all(out.finish[s.id][0] in (ERROR, LENGTH) for s in seqs)
    assert any(out.finish[s.id] == (ERROR, "the server is shutting down") for s in seqs)


def test_sequences_of_one_prompt_share_its_prefill(engine, monkeypatch):
    """A prefill of sequences with the same prompt (a request's n choices) computes the prompt once and copies the
    first one's cache slot into the others': the prefill sees each prompt once, the copied slots equal the computed
    one over the prompt's positions, and every sequence still gets exactly its tokens alone, greedy or seeded."""
    loop, out = make_loop(engine, overlap=False)
    seen = []
    real = engine.prefill_into
    monkeypatch.setattr(engine, "prefill_into",
                        lambda prompts, slots: seen.append(len(prompts)) or real(prompts, slots))
    same = [Sequence(prompt=PROMPTS[1], max_tokens=6, params=SAMPLED, seed=40 + i) for i in range(3)]
    other = Sequence(prompt=PROMPTS[0], max_tokens=6)
    for s in same + [other]:
        loop.submit(s)
    loop.iteration()
    assert seen == [2]  # the shared prompt and the other one
    n = len(PROMPTS[1])
    for part in engine.cache["cache.0"]:
        for s in same[1:]:
            assert part[s.slot, :n].equal(part[same[0].slot, :n])
    run_all(loop)
    for i, s in enumerate(same):
        assert out.tokens[s.id] == alone(QWEN, tuple(PROMPTS[1]), 6, SAMPLED, 40 + i), i
    assert out.tokens[other.id] == alone(QWEN, tuple(PROMPTS[0]), 6)


def test_copy_slot_copies_positions_and_recurrent_state():
    """KVCache.copy_slot (the shared prefill's copy): the first `length` positions of every per-token layer and
    the whole KDA state of each state layer; later positions and other slots untouched."""
    import torch

    from megadecode.cache import KVCache
    from megadecode.presets import preset_config

    cfg = preset_config("tiny-k3")
    cache = KVCache(cfg, 3, 8, "cpu", torch.float32)
    for ts in cache.layers.values():
        for t in ts:
            t.normal_()
    before = {n: [t.clone() for t in ts] for n, ts in cache.layers.items()}
    cache.copy_slot(0, 2, 5)
    assert cache.state_layers and set(cache.layers) - cache.state_layers
    for name, ts in cache.layers.items():
        for t, b in zip(ts, before[name]):
            if name in cache.state_layers:
                assert t[2].equal(b[0])
            else:
                assert t[2, :5].equal(b[0, :5]) and t[2, 5:].equal(b[2, 5:])
            assert t[:2].equal(b[:2])
    with pytest.raises(ValueError, match="copy_slot"):
        cache.copy_slot(1, 1, 3)
