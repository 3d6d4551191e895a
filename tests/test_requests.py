"""Requests through the Engine: every bad request is refused with a message naming what is wrong, and
good ones give the same tokens whatever they are batched with and whichever executor runs them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megadecode.engine import Engine, NonFiniteError, RequestError
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.weights import random_weights

QWEN, DS = "tiny-qwen3-moe", "tiny-deepseek-v3"
MAX_BATCH, MAX_SEQ = 3, 32
GREEDY = SamplingParams(greedy=True)
VOCAB = 259


@pytest.fixture(scope="module", params=[QWEN, DS])
def engine(request):
    return Engine.from_pretrained(request.param, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ)


def refused(engine, prompts, max_new_tokens=1) -> str:
    with pytest.raises(RequestError) as e:
        engine.generate(prompts, max_new_tokens)
    return str(e.value)


# ---- refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 1000, 2**40])
def test_token_id_out_of_range(engine, bad):
    assert engine.cfg.vocab_size == VOCAB
    msg = refused(engine, [[256, 1, 2], [256, 5, bad, 7]])
    assert f"prompt 1 has token id {bad}" in msg
    assert f"[0, {VOCAB})" in msg


@pytest.mark.parametrize("bad", [1.0, "a", None])
def test_token_id_not_an_int(engine, bad):
    msg = refused(engine, [[256, bad]])
    assert f"token id {bad!r}" in msg


def test_last_valid_token_ids_accepted(engine):
    out = engine.generate([[0, VOCAB - 1]], 1, GREEDY)
    assert len(out.token_ids[0]) <= 1


def test_empty_prompt(engine):
    assert "prompt 1 is empty" in refused(engine, [[256, 1], []])


def test_no_prompts(engine):
    assert "no prompts" in refused(engine, [])


def test_prompt_longer_than_context(engine):
    msg = refused(engine, [[1] * (MAX_SEQ + 1)], max_new_tokens=0)
    assert f"prompt 0 has {MAX_SEQ + 1} tokens" in msg and f"context of {MAX_SEQ}" in msg


def test_prompt_plus_new_tokens_longer_than_context(engine):
    msg = refused(engine, [[1, 2], [1] * 30], max_new_tokens=3)
    assert "prompt 1 has 30 tokens" in msg and "33 positions" in msg and f"context of {MAX_SEQ}" in msg


def test_prompt_exactly_filling_context(engine):
    out = engine.generate([[2] * 30], 2, GREEDY, stop_at_eos=False)
    assert len(out.token_ids[0]) == 2


def test_more_prompts_than_cache_slots(engine):
    msg = refused(engine, [[1]] * (MAX_BATCH + 1))
    assert f"{MAX_BATCH + 1} sequences" in msg and f"holds {MAX_BATCH}" in msg


def test_negative_max_new_tokens(engine):
    assert "max_new_tokens must be >= 0, got -1" in refused(engine, [[1]], max_new_tokens=-1)


def test_zero_new_tokens(engine):
    out = engine.generate([[1, 2], [3]], 0)
    assert out.token_ids == [[], []] and out.logprobs == [[], []]


def test_decode_past_the_context(engine):
    engine.prefill([[1] * (MAX_SEQ - 1)])
    engine.decode(torch.tensor([3]))  # fills position MAX_SEQ - 1
    with pytest.raises(RequestError, match=f"context limit of {MAX_SEQ}"):
        engine.decode(torch.tensor([3]))


def test_decode_wrong_number_of_tokens(engine):
    engine.prefill([[1, 2], [3]])
    with pytest.raises(RequestError, match=r"decode expects 2 tokens, got shape \(3,\)"):
        engine.decode(torch.tensor([1, 2, 3]))


def test_unknown_executor():
    with pytest.raises(ValueError, match="unknown executor 'fastest'"):
        Engine.from_pretrained(QWEN, executor="fastest", max_batch=1, max_seq_len=8)


@pytest.mark.parametrize("dtype", ["float64", "fp8", "bf16"])
def test_unknown_dtype(dtype):
    with pytest.raises(ValueError, match=f"unknown dtype '{dtype}'"):
        Engine.from_pretrained(QWEN, dtype=dtype, max_batch=1, max_seq_len=8)


def test_model_neither_preset_nor_directory(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError) as e:
        Engine.from_pretrained(missing)
    assert repr(missing) in str(e.value) and "tiny-qwen3-moe" in str(e.value)
    with pytest.raises(FileNotFoundError, match="'tiny-qwen3'"):
        Engine.from_pretrained("tiny-qwen3")


def test_request_error_is_a_value_error():
    assert issubclass(RequestError, ValueError)


# ---- batch invariance and executor agreement ------------------------------------------------------

PROMPTS = [[256, 72, 101, 108, 108, 111], [256] + list(range(30, 41)), [256, 7]]  # ragged: 6, 12, 2
NEW = 8


@pytest.fixture(scope="module")
def batched(engine):
    return engine.generate(PROMPTS, NEW, GREEDY, stop_at_eos=False)


def test_ragged_batch_equals_each_prompt_alone(engine, batched):
    assert [len(t) for t in batched.token_ids] == [NEW] * len(PROMPTS)
    # The rows decode different continuations: the test would see rows mixed up.
    assert len({tuple(t) for t in batched.token_ids}) == len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], NEW, GREEDY, stop_at_eos=False)  # same engine: stale cache behind it
        assert alone.token_ids[0] == batched.token_ids[i], f"prompt {i}"
        torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(batched.logprobs[i]),
                                   rtol=1e-4, atol=1e-4)


def test_batch_order_does_not_matter(engine, batched):
    rev = engine.generate(PROMPTS[::-1], NEW, GREEDY, stop_at_eos=False)
    assert rev.token_ids[::-1] == batched.token_ids


def test_greedy_logprobs_are_the_max(engine, batched):
    for row in batched.logprobs:
        assert all(lp <= 0 for lp in row)
    # logprob of the greedy token is the largest log-probability of the first step's distribution
    logits = engine.prefill(PROMPTS, NEW)
    top = torch.log_softmax(logits, -1).max(-1)
    assert [r[0] for r in batched.token_ids] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([r[0] for r in batched.logprobs]), top.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", [QWEN, DS])
def test_graph_executor_matches_torch(preset, request):
    torch_eng = Engine.from_pretrained(preset, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ)
    graph_eng = Engine.from_pretrained(preset, executor="graph", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ)
    assert type(graph_eng.executor).__name__ == "GraphExecutor"
    a = torch_eng.generate(PROMPTS, NEW, GREEDY, stop_at_eos=False)
    b = graph_eng.generate(PROMPTS, NEW, GREEDY, stop_at_eos=False)
    assert b.token_ids == a.token_ids
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4)


def test_sampled_generation_is_reproducible(engine):
    params = SamplingParams(temperature=1.5, top_p=0.9)
    a = engine.generate(PROMPTS, 6, params, seed=7, stop_at_eos=False)
    b = engine.generate(PROMPTS, 6, params, seed=7, stop_at_eos=False)
    c = engine.generate(PROMPTS, 6, params, seed=8, stop_at_eos=False)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_at_eos_cuts_after_first_eos():
    cfg = preset_config(QWEN)
    w = random_weights(cfg, seed=0)
    full = Engine(cfg, w, max_batch=2, max_seq_len=MAX_SEQ).generate(PROMPTS[:2], 6, GREEDY, stop_at_eos=False)
    eos = full.token_ids[0][2]  # pretend the third token of row 0 is EOS
    eng = Engine(dataclasses.replace(cfg, eos_token_id=(eos,)), w, max_batch=2, max_seq_len=MAX_SEQ)
    out = eng.generate(PROMPTS[:2], 6, GREEDY)
    for got, lps, row, row_lps in zip(out.token_ids, out.logprobs, full.token_ids, full.logprobs):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert got == row[:cut] and len(lps) == cut
    assert out.token_ids[0][-1] == eos and len(out.token_ids[0]) <= 3


# ---- router correction bias and expert groups are live ---------------------------------------------

def _logits(cfg, weights, prompts):
    return Engine(cfg, weights, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ).prefill(prompts)


def test_router_bias_and_groups_change_the_output():
    """tiny-deepseek-v3 routes with a non-zero selection bias and 4 groups of which 2 are kept; removing
    either must change the logits, or the fast paths could drop them unnoticed."""
    cfg = preset_config(DS)
    w = random_weights(cfg, seed=0)
    base = _logits(cfg, w, PROMPTS)
    biases = [k for k in w if k.endswith("e_score_correction_bias")]
    assert biases and all(w[k].abs().min() > 0 for k in biases)
    no_bias = {k: (torch.zeros_like(v) if k in biases else v) for k, v in w.items()}
    assert (base - _logits(cfg, no_bias, PROMPTS)).abs().max() > 1e-3
    all_groups = dataclasses.replace(cfg, topk_group=cfg.n_group)
    assert (base - _logits(all_groups, w, PROMPTS)).abs().max() > 1e-3
    no_scaling = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    assert (base - _logits(no_scaling, w, PROMPTS)).abs().max() > 1e-3


def test_engine_request_shape_errors():
    from megadecode.engine import Engine, RequestError

    eng = Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=32)
    with pytest.raises(RequestError, match="flat list"):
        eng.generate([1, 2, 3], 2)
    with pytest.raises(RequestError, match="not an integer"):
        eng.generate([[1, 2.5]], 2)
    with pytest.raises(RequestError, match="max_new_tokens"):
        eng.generate([[1, 2]], 2.5)
    with pytest.raises(RequestError, match=r"max_seq_len 100000 is outside \[1, 512\].*max_position_embeddings"):
        Engine.from_pretrained("tiny-qwen3-moe", max_seq_len=100000)
    # numpy / torch integers are valid ids
    import numpy as np
    assert len(eng.generate([[np.int64(1), torch.tensor(2).item(), 3]], 2).token_ids[0]) <= 2


def test_engine_checks_weights_against_the_table():
    from megadecode.engine import Engine, RequestError
    from megadecode.presets import preset_config
    from megadecode.weights import random_weights

    cfg = preset_config("tiny-deepseek-v3")
    w = random_weights(cfg)
    w.pop("model.norm.weight")
    with pytest.raises(RequestError, match="model.norm.weight"):
        Engine(cfg, w)
    w = random_weights(cfg)
    w["lm_head.weight"] = w["lm_head.weight"][:, :8]
    with pytest.raises(RequestError, match="lm_head.weight"):
        Engine(cfg, w)


def test_compiled_executor_refuses_unvalidated_families():
    from megadecode.engine import Engine

    with pytest.raises(ValueError, match="the compiled executor is not validated for deepseek_v3"):
        Engine.from_pretrained("tiny-deepseek-v3", executor="compiled")


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70, 1.5, True])
def test_seed_out_of_range_is_a_request_error(seed):
    """Not torch's `Overflow when unpacking long long` (a seed past 64 bits) or a silently wrapped int64."""
    with pytest.raises(RequestError, match=r"seed must be an integer in \[0, 4294967295\]"):
        Engine.from_pretrained(QWEN, seed=seed, max_batch=1, max_seq_len=8)
    eng = Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=8)
    with pytest.raises(RequestError, match="seed must be"):
        eng.generate([[1, 2]], 2, seed=seed)
    assert len(eng.generate([[1, 2]], 2, seed=2**32 - 1, stop_at_eos=False).token_ids[0]) == 2


@pytest.mark.parametrize("executor", ["torch", "graph", "pyvm"])
def test_non_finite_logits_end_generate_naming_the_sequence_and_step(executor):
    """A NaN in the embedding row of a token that only sequence 1 feeds, at its second decode step: generate
    raises naming that sequence and step (the flag is kept on the device by each step, read once at the end),
    and the next clean run passes (the flag is reset per generate)."""
    cfg = preset_config(QWEN)
    w = random_weights(cfg, seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    eng = Engine(cfg, w, executor=executor, max_batch=2, max_seq_len=16)
    clean = eng.generate(prompts, 4, GREEDY, stop_at_eos=False).token_ids
    t = clean[1][1]  # fed by sequence 1's decode step 2 (position 3), by no step of sequence 0
    assert t not in prompts[0] + prompts[1] + clean[0] + clean[1][:1]
    emb = w["model.embed_tokens.weight"]
    saved, saved_4 = emb[t, 0].item(), emb[4, 0].item()
    emb[t, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^sequence 1: the logits for generated token 2 \(decode step 2 of 3, "
                                             r"position 3\) hold NaN or inf"):
        eng.generate(prompts, 4, GREEDY, stop_at_eos=False)
    emb[t, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"^sequence 1: the logits for generated token 2 \(decode step 2"):
        eng.generate(prompts, 4, GREEDY, stop_at_eos=False)
    emb[t, 0] = saved
    emb[4, 0] = float("nan")  # sequence 1's first prompt token: its prefill logits
    with pytest.raises(NonFiniteError, match=r"^sequence 1: the logits for generated token 0 \(the prefill, "
                                             r"position 1\)"):
        eng.generate(prompts, 4, SamplingParams(temperature=0.8), stop_at_eos=False)
    emb[4, 0] = saved_4
    assert eng.generate(prompts, 4, GREEDY, stop_at_eos=False).token_ids == clean
