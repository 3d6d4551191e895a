"""Speculative decoding with a draft model (`--speculative draft --draft-model M`, speculative.DraftModelDrafter):
the drafts are the draft model's greedy continuation however the drafter's cache slots are reused, greedy output
is the target's own, a draft model equal to the target has every draft accepted, and what cannot draft is refused
with one line naming why."""

from __future__ import annotations

import pytest
import torch

from megadecode.engine import Engine, RequestError
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.speculative import DraftModelDrafter, check_draft_model, generate
from megadecode.weights import random_weights

V = preset_config("tiny-qwen3-moe").vocab_size


def _engine(preset: str, batch: int, seed: int = 0, executor: str = "torch") -> Engine:
    cfg = preset_config(preset)
    return Engine(cfg, random_weights(cfg, "cpu", torch.float32, seed), executor=executor, max_batch=batch,
                  max_seq_len=192)


def _greedy(engine: Engine, tokens: list[int], k: int) -> list[int]:
    """The draft model's own greedy continuation of `tokens`, from a fresh prefill."""
    return engine.generate([tokens], k, SamplingParams(greedy=True), stop_at_eos=False).token_ids[0]


def test_drafts_are_the_draft_models_greedy_continuation_however_slots_are_reused():
    """Sequences growing as a verify loop grows them (an accepted draft, then a token of the target's) on a drafter
    of two slots: each draft equals the draft model's fresh greedy continuation; a sequence that extends what its
    slot holds feeds only the target's token (the accepted draft's entries are in the slot already), then one token
    a step; a third sequence takes the least recently used slot, and the sequence it evicted is fed whole again."""
    drafter = DraftModelDrafter(_engine("tiny-deepseek-v3", 2, seed=3), 4, V)
    oracle = _engine("tiny-deepseek-v3", 1, seed=3)
    fed = []
    step = drafter._step
    drafter._step = lambda pieces: (fed.extend((len(f), p, s) for f, p, s in pieces), step(pieces))[1]
    seqs = {"a": [5, 6, 7, 8, 9], "b": [40, 41], "c": [100, 3, 3, 3, 3, 3, 3]}
    slot_of = {}

    def draft(name: str, new: int):
        s = seqs[name]
        fed.clear()
        d = drafter.draft(s)
        assert d == _greedy(oracle, s, 4), name
        assert fed[0][:2] == (new, len(s) - new), (name, fed)
        assert [f[0] for f in fed[1:]] == [1, 1, 1] and len({f[2] for f in fed}) == 1
        slot_of[name] = fed[0][2]
        seqs[name] = s + [d[0], (d[1] + 1) % V]  # the target accepts one draft and corrects the next

    draft("a", 5)
    draft("b", 2)
    assert slot_of["a"] != slot_of["b"]
    draft("a", 1)
    draft("b", 1)
    draft("c", 7)  # a was used least recently: its slot is taken
    assert slot_of["c"] == slot_of["a"]
    draft("b", 1)
    draft("a", len(seqs["a"]))  # fed whole again, into c's slot (used before b's)
    assert slot_of["a"] == slot_of["c"]


def test_a_steps_sequences_are_drafted_together():
    """draft_many: three sequences (one near the end of the draft's context, so it takes fewer drafts) on three
    slots in k steps of the draft model, each step feeding every sequence still drafting; on two slots, two groups
    (the first two sequences' 4 steps, then the third's 2).
    Each sequence's drafts are the draft model's fresh greedy continuation either way."""
    oracle = _engine("tiny-deepseek-v3", 1, seed=4)
    seqs = [[5, 6, 7, 8, 9], [40, 41], list(range(1, 191))]  # max_seq_len 192: the last takes 2 drafts
    want = [_greedy(oracle, q, 4 if len(q) < 100 else 2) for q in seqs]
    for slots, sizes_want in ((3, [3, 3, 2, 2]), (2, [2, 2, 2, 2, 1, 1])):
        drafter = DraftModelDrafter(_engine("tiny-deepseek-v3", slots, seed=4), 4, V)
        sizes = []
        step = drafter._step
        drafter._step = lambda pieces: (sizes.append(len(pieces)), step(pieces))[1]
        assert drafter.draft_many(seqs) == want
        assert sizes == sizes_want  # (three slots: the third sequence's 2 drafts take the first two steps)
        assert drafter.draft_many([q + [1] for q in seqs[:2]]) == [_greedy(oracle, q + [1], 4) for q in seqs[:2]]


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted():
    prompts = [[3, 4, 5, 6] * 3, [9, 8, 7, 1], [11, 40, 2]]
    want = _engine("tiny-qwen3-moe", 3).generate(prompts, 48, SamplingParams(greedy=True), stop_at_eos=False)
    res = generate(_engine("tiny-qwen3-moe", 3), prompts, 48, DraftModelDrafter(_engine("tiny-qwen3-moe", 3), 4, V),
                   stop_at_eos=False)
    assert res.token_ids == want.token_ids
    assert res.drafted > 0 and res.acceptance >= 0.95
    assert res.tokens_per_step > 3.5  # k = 4: up to 5 tokens a step


@pytest.mark.parametrize("executor", ["torch", "graph"])
def test_greedy_output_with_another_draft_model_is_the_targets(executor):
    prompts = [[3, 4, 5, 6] * 3, [11, 40, 2]]
    want = _engine("tiny-qwen3-moe", 2).generate(prompts, 40, SamplingParams(greedy=True), stop_at_eos=False)
    drafter = DraftModelDrafter(_engine("tiny-deepseek-v3", 1, seed=7, executor=executor), 3, V)  # one slot, two
    res = generate(_engine("tiny-qwen3-moe", 2), prompts, 40, drafter, stop_at_eos=False)
    assert res.token_ids == want.token_ids
    assert res.drafted > 0


def test_sampled_speculation_with_a_draft_model_runs_to_length():
    res = generate(_engine("tiny-qwen3-moe", 2), [[1, 2, 3], [7]], 16, DraftModelDrafter(_engine("tiny-qwen3-moe", 2),
                   3, V), SamplingParams(temperature=0.8), seed=5, stop_at_eos=False)
    assert [len(t) for t in res.token_ids] == [16, 16]
    assert all(0 <= t < V for seq in res.token_ids for t in seq)


def test_a_draft_model_that_cannot_draft_is_refused():
    with pytest.raises(RequestError, match="vocabulary has 151936 tokens, the target's 259"):
        check_draft_model(preset_config("qwen3-30b-a3b"), V)
    with pytest.raises(RequestError, match="kimi_k3 draft model is not taken"):
        check_draft_model(preset_config("tiny-k3"), V)
    with pytest.raises(RequestError, match=r"draft tokens must be in \[1, 7\]"):
        DraftModelDrafter(_engine("tiny-qwen3-moe", 1), 8, V)
    near_end = DraftModelDrafter(_engine("tiny-qwen3-moe", 1), 4, V)
    assert near_end.draft(list(range(1, 190))) == _greedy(_engine("tiny-qwen3-moe", 1), list(range(1, 190)), 3)
    assert near_end.draft(list(range(1, 193))) == []  # no position left in the draft's cache


def test_generate_cli_with_a_draft_model(capsys):
    from test_cli import fails, run_json

    argv = ["generate", "--json", "--model", "tiny-qwen3-moe", "--token-ids", "3,4,5,6,7", "--max-new-tokens", "24",
            "--greedy", "--ignore-eos"]
    plain = run_json(capsys, argv)
    spec = run_json(capsys, argv + ["--speculative", "draft", "--draft-model", "tiny-qwen3-moe"])
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["speculative"]
    assert s["drafter"] == "draft" and s["draft_model"] == "tiny-qwen3-moe" and s["acceptance"] >= 0.95
    assert "--speculative draft needs --draft-model" in fails(capsys, ["generate", "--speculative", "draft"])
    assert "--draft-model needs --speculative draft" in fails(capsys, ["generate", "--draft-model", "tiny-qwen3-moe"])
    assert "--draft-model needs --speculative draft" in fails(capsys, ["generate", "--speculative", "ngram",
                                                                        "--draft-model", "tiny-qwen3-moe"])
    assert "vocabulary has 151936 tokens" in fails(capsys, ["generate", "--speculative", "draft", "--greedy",
                                                            "--draft-model", "qwen3-30b-a3b"])
    assert "kimi_k3 draft model is not taken" in fails(capsys, ["generate", "--speculative", "draft", "--greedy",
                                                                "--draft-model", "tiny-k3"])
