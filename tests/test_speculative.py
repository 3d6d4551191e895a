"""Speculative decoding (megadecode/speculative.py) on the CPU: the n-gram drafter, greedy output identical to
plain greedy generation with drafts verified a step at a time (fp32, qwen3_moe, deepseek_v3, and the KDA families,
whose recurrent state is rewound to the accepted prefix), drafts accepted where the text repeats, and what is
refused."""

from __future__ import annotations

import pytest
import torch

from megadecode.engine import Engine, RequestError
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.speculative import NgramDrafter, generate
from megadecode.step import Step
from megadecode.weights import random_weights


def test_the_ngram_drafter_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_tail():
    d = NgramDrafter(3, max_n=3)
    assert d.draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]) == [7, 5, 1]  # the latest of the two occurrences
    assert d.draft([5, 6, 5]) == [6, 5]  # 1-gram, fewer than k left
    assert d.draft([1, 2, 3]) == []
    assert NgramDrafter(2, max_n=2).draft([4, 8, 4, 9, 4]) == [9, 4]
    for bad in (0, 8):
        with pytest.raises(RequestError, match="draft tokens"):
            NgramDrafter(bad)
    assert NgramDrafter(3).draft([7]) == [] and NgramDrafter(3, min_n=2).draft([7, 7]) == []


def test_the_ngram_drafter_equals_its_definition_on_random_sequences():
    """The vectorized search against the definition written as loops (longest n first, then the latest earlier
    start), on 400 random sequences of small vocabularies (many repeats) and lengths 1 to 60."""
    def by_loops(tokens, k, max_n, min_n):
        L = len(tokens)
        for n in range(min(max_n, L - 1), min_n - 1, -1):
            for start in range(L - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[L - n:]:
                    return tokens[start + n:start + n + k]
        return []

    g = torch.Generator().manual_seed(3)
    for i in range(400):
        L = int(torch.randint(1, 61, (1,), generator=g))
        tokens = torch.randint(0, 2 + i % 6, (L,), generator=g).tolist()
        k, max_n = 1 + i % 7, 1 + i % 5
        min_n = 1 + (i // 5) % max_n
        assert NgramDrafter(k, max_n, min_n).draft(tokens) == by_loops(tokens, k, max_n, min_n), (tokens, k, max_n)


def _engine(preset: str, batch: int, seed: int = 0, executor: str = "torch") -> Engine:
    cfg = preset_config(preset)
    return Engine(cfg, random_weights(cfg, "cpu", torch.float32, seed), executor=executor, max_batch=batch,
                  max_seq_len=256)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_greedy_speculative_output_is_greedy_output(preset):
    """Three prompts, two of them repetitive (drafts found and accepted), one not; 96 new tokens each, EOS ignored
    so every sequence runs to the end; k = 3 and 7."""
    prompts = [[3, 4, 5, 6] * 6, [9, 8, 7] * 5 + [1], [11, 40, 2]]
    ref = _engine(preset, 3).generate(prompts, 96, SamplingParams(greedy=True), stop_at_eos=False)
    want = ref.token_ids
    for k in (3, 7):
        res = generate(_engine(preset, 3), prompts, 96, NgramDrafter(k), stop_at_eos=False)
        assert res.token_ids == want
        assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
        assert res.drafted > 0 and res.accepted > 0 and res.steps < 95
        assert res.tokens_per_step > 1.0


def test_speculative_generation_stops_at_eos_and_max_tokens_as_generate_does():
    eng = _engine("tiny-qwen3-moe", 2, seed=1)
    prompts = [[5, 6, 7] * 4, [1, 2]]
    want = _engine("tiny-qwen3-moe", 2, seed=1).generate(prompts, 40, SamplingParams(greedy=True)).token_ids
    assert generate(eng, prompts, 40, NgramDrafter(4)).token_ids == want
    assert [len(t) for t in generate(_engine("tiny-qwen3-moe", 2), prompts, 5, NgramDrafter(7),
                                     stop_at_eos=False).token_ids] == [5, 5]


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_greedy_speculative_output_is_greedy_output_with_kda_layers(preset):
    """KDA's recurrent state continues from the slot in a verify step and is rewound to the accepted prefix: the
    greedy tokens equal plain greedy generation while drafts are both accepted and rejected."""
    prompts = [[3, 4, 5, 6] * 6, [9, 8, 7] * 5 + [1]]
    ref = _engine(preset, 2).generate(prompts, 48, SamplingParams(greedy=True), stop_at_eos=False)
    res = generate(_engine(preset, 2), prompts, 48, NgramDrafter(4), stop_at_eos=False)
    assert res.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    assert 0 < res.accepted < res.drafted  # some drafts kept, some rewound


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear"])
def test_a_rewound_verify_step_leaves_the_state_of_its_accepted_prefix(preset):
    """A verify step feeding four tokens, rewound to its first kept ones, leaves each KDA layer's conv and
    recurrent state (and the next logits) as decoding just those tokens one step at a time does; kept = 4 is the
    step's own end state. The slot's state before the step is poisoned nowhere: a segment past position 0 reads
    it (a verify step that started from zeros would differ at once)."""
    from megadecode.speculative import rewind_states, verify_step

    prompt, fed = [5, 9, 2, 7, 7, 1], [11, 4, 30, 8]
    for kept in (1, 2, 4):
        want = _engine(preset, 1)
        want.prefill([prompt])
        for t in fed[:kept]:
            logits = want.decode(torch.tensor([t]))
        got = _engine(preset, 1)
        got.prefill([prompt])
        step, _ = verify_step([fed], [len(prompt)], [0], "cpu")
        rows = got.executor.run_ops(step).buf["logits"]
        assert len(step.state_trace) == sum(got.cfg.is_kda(i) for i in range(got.cfg.num_layers)) > 0
        rewind_states(step, {0: kept})
        assert torch.allclose(rows[kept - 1], logits[0], atol=1e-4, rtol=1e-4)
        for name in want.cache.state_layers:
            for a, b in zip(want.cache[name], got.cache[name]):
                assert torch.allclose(a[0], b[0], atol=1e-5, rtol=1e-5), (name, kept)
    with pytest.raises(ValueError, match="keeps 1..4"):
        step.state_trace[0].rewind(0)


def test_generate_cli_speculative_is_greedy_and_reports_its_drafts(capsys):
    from test_cli import fails, run_json

    argv = ["generate", "--json", "--model", "tiny-deepseek-v3", "--token-ids", ",".join(["3,4,5"] * 6),
            "--max-new-tokens", "40", "--greedy", "--ignore-eos"]
    plain = run_json(capsys, argv)
    spec = run_json(capsys, argv + ["--speculative", "ngram", "--num-draft-tokens", "5"])
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["speculative"]
    assert s["drafted"] > 0 and s["steps"] < 39 and 0 <= s["acceptance"] <= 1 and s["num_draft_tokens"] == 5
    assert "does not take the penalties" in fails(capsys, ["generate", "--speculative", "ngram",
                                                           "--presence-penalty", "1"])
    sampled = run_json(capsys, ["generate", "--json", "--speculative", "ngram", "--max-new-tokens", "12", "--seed", "4",
                                "--ignore-eos"])
    assert len(sampled["token_ids"][0]) == 12 and sampled["speculative"]["steps"] <= 11
    assert "--num-draft-tokens must be in [1, 7]" in fails(capsys, ["generate", "--speculative", "ngram", "--greedy",
                                                                     "--num-draft-tokens", "9"])
    k3 = ["generate", "--json", "--model", "tiny-k3", "--token-ids", ",".join(["3,4,5"] * 6), "--max-new-tokens",
          "24", "--greedy", "--ignore-eos"]
    assert run_json(capsys, k3 + ["--speculative", "ngram"])["token_ids"] == run_json(capsys, k3)["token_ids"]
    assert "cannot be used with --min-tokens" in fails(capsys, ["generate", "--speculative", "ngram", "--greedy",
                                                                "--min-tokens", "2"])


def test_the_rejection_rule_emits_tokens_distributed_as_the_target_on_fixed_logits():
    """k = 2 drafts over a vocabulary of 6, 40000 draws: the first emitted token is distributed as p0 (draft or
    correction), and after an accepted first draft the second as p1; a draft the target gives probability 0 is
    never kept, one it gives probability 1 always is."""
    from megadecode.speculative import accept_drafts

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)
    drafts = [2, 4]
    n = 40000
    first = torch.zeros(6)
    second = torch.zeros(6)
    kept = 0
    for _ in range(n):
        out = accept_drafts(probs, drafts, torch.rand(2, generator=g).tolist(),
                            torch.empty(6).exponential_(1.0, generator=g))
        first[out[0]] += 1
        if out[0] == drafts[0]:
            kept += 1
            second[out[1]] += 1
    assert (first / n - probs[0]).abs().max() < 0.012, (first / n, probs[0])
    assert (second / kept - probs[1]).abs().max() < 0.02, (second / kept, probs[1])
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(200):
        u, e = torch.rand(2, generator=g).tolist(), torch.empty(3).exponential_(1.0, generator=g)
        assert accept_drafts(p, [1, 1], u, e) in ([1, 0], [1, 2])  # kept at probability 1, replaced at 0
        assert accept_drafts(p, [0, 2], u, e) == [1]  # probability 0: replaced by the only token left


def test_sampled_speculation_cut_to_one_token_is_greedy():
    """top_k = 1: the target's distribution is one-hot at its argmax, so sampled speculation must emit the greedy
    tokens, whatever the draws."""
    prompts = [[3, 4, 5, 6] * 6, [11, 40, 2]]
    want = _engine("tiny-qwen3-moe", 2).generate(prompts, 48, SamplingParams(greedy=True), stop_at_eos=False)
    res = generate(_engine("tiny-qwen3-moe", 2), prompts, 48, NgramDrafter(4),
                   SamplingParams(temperature=0.8, top_k=1), seed=3, stop_at_eos=False)
    assert res.token_ids == want.token_ids and res.accepted > 0
    res = generate(_engine("tiny-qwen3-moe", 2), prompts, 48, NgramDrafter(4), SamplingParams(temperature=1.0),
                   seed=3, stop_at_eos=False)
    assert [len(t) for t in res.token_ids] == [48, 48] and res.drafted > 0
    with pytest.raises(RequestError, match="no penalties or logit bias"):
        generate(_engine("tiny-qwen3-moe", 2), prompts, 4, NgramDrafter(2), SamplingParams(presence_penalty=1.0))


def test_an_oracle_drafter_of_the_greedy_continuation_has_every_draft_accepted():
    from megadecode.speculative import OracleDrafter

    prompts = [[11, 40, 2], [7, 7, 1, 9]]
    ref = _engine("tiny-deepseek-v3", 2).generate(prompts, 30, SamplingParams(greedy=True), stop_at_eos=False)
    full = [p + t for p, t in zip(prompts, ref.token_ids)]
    assert OracleDrafter(3, full).draft(full[1][:6]) == full[1][6:9] and OracleDrafter(3, full).draft([1, 2]) == []
    res = generate(_engine("tiny-deepseek-v3", 2), prompts, 30, OracleDrafter(5, full), stop_at_eos=False)
    assert res.token_ids == ref.token_ids and res.acceptance == 1.0 and res.steps == 5  # 29 tokens, 6 a step


def test_the_speculative_benchmark_runs_on_the_cpu(tmp_path):
    """bench/spec_bench.py on tiny-qwen3-moe: every draft of the oracle accepted, the output asserted equal; with
    --draft-model the draft model's rows follow (here the target itself: its drafts accepted too)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import spec_bench

    out = tmp_path / "spec.json"
    assert spec_bench.main(["--preset", "tiny-qwen3-moe", "--executor", "torch", "--device", "cpu", "--dtype",
                            "float32", "--k", "2,5", "--tokens", "20", "--draft-model", "tiny-qwen3-moe",
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["drafter"], r["k"]) for r in doc["rows"]] == [("oracle", 2), ("oracle", 5), ("draft", 2), ("draft", 5)]
    assert all(r["acceptance"] >= 0.95 for r in doc["rows"]) and doc["draft_model"] == "tiny-qwen3-moe"
    assert all(r["agree_tokens"] == r["tokens"] == 20 for r in doc["rows"])
    assert [(r["k"], r["rows"]) for r in doc["verify_steps"]] == [(2, 3), (5, 6)]
    assert all(r["verify_ms"] > 0 and r["one_row_ms"] > 0 for r in doc["verify_steps"])
    assert [r["steps"] for r in doc["rows"][:2]] == [7, 4]  # 19 tokens after the prefill's: 3 and 6 a step


@pytest.mark.parametrize("executor, tokens", [("graph", 64), ("pyvm", 24)])
def test_greedy_speculation_equals_greedy_generation_on_other_executors(executor, tokens):
    """The verify step runs the executor's own prefill ops; its greedy tokens are the executor's greedy
    generation's (graph: eager on the CPU; pyvm: the megakernel's golden model decodes, the reference prefills)."""
    prompts = [[3, 4, 5, 6] * 5, [8, 1, 8, 1, 8]]
    want = _engine("tiny-deepseek-v3", 2, executor=executor).generate(prompts, tokens, SamplingParams(greedy=True),
                                                                     stop_at_eos=False).token_ids
    res = generate(_engine("tiny-deepseek-v3", 2, executor=executor), prompts, tokens, NgramDrafter(3),
                   stop_at_eos=False)
    assert res.token_ids == want and res.drafted > 0


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_long_greedy_generations_with_and_without_speculation_are_the_same(preset):
    """Issue 43's check near its length: 200 greedy tokens (the cache holds 256 positions) of a repetitive and a
    plain prompt, k = 5."""
    prompts = [[5, 9, 5, 9, 5, 9, 7] * 3, [200, 13, 77]]
    want = _engine(preset, 2).generate(prompts, 200, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    res = generate(_engine(preset, 2), prompts, 200, NgramDrafter(5), stop_at_eos=False)
    assert res.token_ids == want and res.accepted > 0


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_the_verify_step_as_a_decode_step_equals_its_prefill_form(preset):
    """run_verify's decode form (a row per fed token, two sequences' feeds of 4 and 1 rows, 5 rows on 2 slots)
    against the segment form of the same step: every row's logits, and the cache entries both wrote. Each row sees
    the entries its sequence's earlier rows wrote in the same step: a row that missed them would differ."""
    from megadecode.speculative import run_verify, verifies_as_decode, verify_step

    prompts, feeds = [[5, 9, 2, 7, 7, 1], [40, 3, 3]], [[11, 4, 30, 8], [17]]
    first = [len(p) for p in prompts]
    want, got = _engine(preset, 2), _engine(preset, 2)
    for e in (want, got):
        e.prefill(prompts)
    assert verifies_as_decode(got)
    step, starts = verify_step(feeds, first, [0, 1], "cpu")
    ref = want.executor.run_ops(step).buf["logits"]
    dstep, dstarts, logits, h = run_verify(got, feeds, first, [0, 1])
    assert dstep.segments is None and dstarts == starts == [0, 4] and h is None
    assert torch.isfinite(ref).all() and torch.allclose(logits, ref, atol=1e-4, rtol=1e-4)
    for name in want.cache.layers:
        for a, b in zip(want.cache[name], got.cache[name]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), name
    # a drafter that reads hidden states takes the prefill form, its rows the final norm's input
    _, _, logits2, h2 = run_verify(got, feeds, first, [0, 1], hidden=True)
    assert h2.shape == (5, got.cfg.hidden_size) and torch.allclose(logits2, ref, atol=1e-4, rtol=1e-4)


def test_the_megakernels_verify_program_writes_every_rows_cache_entry_before_attention():
    """A decode step of one sequence's 3 rows on the megakernel's program (pyvm, its race check on): the shipped
    program's GQA attention writes a row's key and value in the phase where the other rows read the cache (a race
    pyvm finds); the causal-rows program (Step.causal_rows, lower's F_KV_WRITE phase) has none, and its logits are
    the prefill form's. MLA layers write their cache (MLA_KV) two phases before attention in both. A KDA layer's
    decode step advances a slot's state once: kimi_linear verifies in the prefill form."""
    from megadecode.backends.mega.pyvm_executor import PyVMExecutor
    from megadecode.speculative import verifies_as_decode, verify_step

    assert not verifies_as_decode(_engine("tiny-kimi-linear", 1))
    prompt, fed = [5, 9, 2, 7], [11, 4, 30]
    for preset, shipped_races in (("tiny-qwen3-moe", True), ("tiny-deepseek-v3", False)):
        ref = _engine(preset, 1)
        ref.prefill([prompt])
        step, _ = verify_step([fed], [len(prompt)], [0], "cpu")
        want = ref.executor.run_ops(step).buf["logits"]
        eng = _engine(preset, 1, executor="pyvm")
        assert verifies_as_decode(eng)
        vm = PyVMExecutor(eng.plan, eng.executor.weights, eng.cache, check_races=True)
        for causal in (False, True):
            eng.prefill([prompt])
            step = Step(tokens=torch.tensor(fed), positions=torch.arange(4, 7), slots=torch.zeros(3).long(),
                        logit_rows=torch.arange(3), kv_len=7, causal_rows=causal)
            if shipped_races and not causal:
                with pytest.raises(RuntimeError, match="unordered accesses"):
                    vm.decode(step)
                continue
            got = vm.decode(step)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (preset, causal)


def test_greedy_speculation_on_the_fused_executor_is_its_greedy_generation():
    """The fused executor's verify step is its decode step of the fed tokens (its Triton kernels, interpreted on
    the CPU in fp32): the greedy tokens are its greedy generation's."""
    prompts = [[3, 4, 5, 6] * 4, [8, 1, 8, 1, 8]]
    want = _engine("tiny-qwen3-moe", 2, executor="fused").generate(prompts, 24, SamplingParams(greedy=True),
                                                                   stop_at_eos=False).token_ids
    res = generate(_engine("tiny-qwen3-moe", 2, executor="fused"), prompts, 24, NgramDrafter(3), stop_at_eos=False)
    assert res.token_ids == want and res.accepted > 0
