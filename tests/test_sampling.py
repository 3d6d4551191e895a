"""Token selection: greedy is argmax, logprobs are the model's (T = 1), sampling draws from the
(temperature-scaled, nucleus-truncated) distribution, reproducibly, and bad parameters are refused."""

from __future__ import annotations

import math

import pytest
import torch

from megadecode.sampling import SamplingParams, sample


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(probs: list[float], n: int) -> torch.Tensor:
    """n identical rows of logits with softmax = probs."""
    return torch.tensor(probs).log().expand(n, -1).contiguous()


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001, by degrees of freedom (a correct sampler fails 1 in 1000 seeds;
# the seeds are fixed, so the test is deterministic).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27}


def test_greedy_is_argmax():
    logits = torch.randn(16, 300, generator=gen(0))
    tokens, lps = sample(logits, SamplingParams(greedy=True))
    assert tokens.dtype == torch.int64 and tokens.shape == (16,)
    assert torch.equal(tokens, logits.argmax(-1))
    assert lps.dtype == torch.float32 and lps.shape == (16,)
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).max(-1).values)


def test_greedy_ignores_temperature_and_generator():
    logits = torch.randn(8, 50, generator=gen(1))
    a, _ = sample(logits, SamplingParams(greedy=True, temperature=0.0))
    b, _ = sample(logits, SamplingParams(greedy=True, temperature=3.0, top_p=0.2), gen(5))
    assert torch.equal(a, logits.argmax(-1)) and torch.equal(b, a)


@pytest.mark.parametrize("params", [SamplingParams(greedy=True), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=2.0, top_p=0.8)])
def test_logprobs_are_log_softmax_of_the_chosen_token(params):
    logits = torch.randn(64, 40, generator=gen(2)) * 3
    tokens, lps = sample(logits, params, gen(3))
    # Under the model at T = 1, whatever the sampling temperature.
    want = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0].float()
    torch.testing.assert_close(lps, want, rtol=1e-5, atol=1e-5)


def test_half_precision_logits():
    logits = torch.randn(4, 32, generator=gen(4)).to(torch.bfloat16)
    tokens, lps = sample(logits, SamplingParams(greedy=True))
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert lps.dtype == torch.float32
    torch.testing.assert_close(lps, torch.log_softmax(logits.float(), -1).max(-1).values)


def test_tiny_top_p_always_returns_the_argmax():
    logits = torch.randn(256, 100, generator=gen(5))
    for seed in range(5):
        for t in (0.5, 1.0, 5.0):
            tokens, _ = sample(logits, SamplingParams(temperature=t, top_p=1e-6), gen(seed))
            assert torch.equal(tokens, logits.argmax(-1))


def test_sampling_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(512, 64, generator=gen(6))
    p = SamplingParams(temperature=1.3, top_p=0.95)
    a, la = sample(logits, p, gen(42))
    b, lb = sample(logits, p, gen(42))
    c, _ = sample(logits, p, gen(43))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert (a != c).sum() > 100  # a different seed draws differently
    assert (a != logits.argmax(-1)).sum() > 100  # and it is not greedy


@pytest.mark.parametrize("seed", [0, 1])
def test_empirical_frequencies_match_probabilities(seed):
    probs = [0.2, 0.5, 0.3]
    tokens, _ = sample(rows(probs, 30000), SamplingParams(), gen(seed))
    assert chi_square(tokens, probs) < CHI2_999[2]
    torch.testing.assert_close(frequencies(tokens, 3), torch.tensor(probs, dtype=torch.float64), atol=0.015, rtol=0)


def test_draws_over_successive_calls_match_probabilities():
    """One generator used step after step (as generate does) keeps drawing from p."""
    probs = [0.1, 0.6, 0.3]
    g = gen(9)
    tokens = torch.cat([sample(rows(probs, 100), SamplingParams(), g)[0] for _ in range(200)])
    assert chi_square(tokens, probs) < CHI2_999[2]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    probs = [0.2, 0.5, 0.3]
    scaled = torch.softmax(torch.tensor(probs).log() / temperature, -1).tolist()
    tokens, lps = sample(rows(probs, 30000), SamplingParams(temperature=temperature), gen(10))
    assert chi_square(tokens, scaled) < CHI2_999[2]
    torch.testing.assert_close(lps, torch.tensor(probs).log()[tokens])  # still T = 1 logprobs


def test_top_p_keeps_only_the_nucleus():
    # Sorted mass: 0.4, 0.3 | 0.2, 0.1. With top_p = 0.5 the nucleus is the smallest set whose mass
    # reaches 0.5: {0.4, 0.3}. The vocabulary order is shuffled so the nucleus is not a prefix.
    probs = [0.2, 0.4, 0.1, 0.3]
    tokens, _ = sample(rows(probs, 30000), SamplingParams(top_p=0.5), gen(11))
    assert set(tokens.tolist()) == {1, 3}
    assert chi_square(tokens, [0, 0.4 / 0.7, 0, 0.3 / 0.7]) < CHI2_999[1]


def test_top_p_nucleus_that_reaches_top_p_exactly():
    # Four tokens of exactly 0.25: two of them reach top_p = 0.5, so a third is never drawn.
    tokens, _ = sample(torch.zeros(4000, 4), SamplingParams(top_p=0.5), gen(16))
    assert len(set(tokens.tolist())) == 2


def test_top_p_per_row_nucleus():
    logits = torch.randn(2000, 30, generator=gen(12)) * 2
    top_p = 0.5
    tokens, _ = sample(logits, SamplingParams(top_p=top_p), gen(13))
    probs = torch.softmax(logits.double(), -1)
    # A token is in the nucleus when the mass of the tokens strictly more likely than it is < top_p.
    chosen = probs.gather(-1, tokens[:, None])
    mass_above = (probs * (probs > chosen)).sum(-1)
    assert (mass_above < top_p).all()
    assert (tokens != logits.argmax(-1)).any()


def test_top_p_applies_after_temperature():
    # At T = 1 the nucleus (top_p 0.6) is {0.5, 0.3}; at T = 0.25 the top token alone holds > 0.6.
    probs = [0.5, 0.3, 0.2]
    t1, _ = sample(rows(probs, 5000), SamplingParams(top_p=0.6), gen(14))
    assert set(t1.tolist()) == {0, 1}
    t_low, _ = sample(rows(probs, 5000), SamplingParams(temperature=0.25, top_p=0.6), gen(14))
    assert set(t_low.tolist()) == {0}


def test_masked_tokens_are_never_sampled():
    logits = torch.zeros(5000, 6)
    logits[:, ::2] = float("-inf")
    for p in (SamplingParams(), SamplingParams(temperature=3.0, top_p=0.9)):
        tokens, lps = sample(logits, p, gen(15))
        assert set(tokens.tolist()) <= {1, 3, 5}
        torch.testing.assert_close(lps, torch.full((5000,), -math.log(3)))


@pytest.mark.parametrize("kw, text", [
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"greedy": True, "top_p": 2.0}, "top_p"),
])
def test_invalid_params(kw, text):
    with pytest.raises(ValueError, match=text):
        SamplingParams(**kw)


def test_valid_edge_params():
    SamplingParams(top_p=1.0)
    SamplingParams(greedy=True, temperature=0.0)
    SamplingParams(temperature=1e-3, top_p=1e-9)


@pytest.mark.parametrize("shape", [(10,), (2, 3, 4)])
def test_logits_must_be_2d(shape):
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        sample(torch.zeros(shape), SamplingParams(greedy=True))


# ---- sample_rows: each row its own params and generator (the server) ---------------------------------------------

def test_sample_rows_equals_sample_row_by_row():
    """A row drawn with its own generator gets what `sample` of that row alone gives with that generator, over
    successive steps, whatever the other rows are (greedy rows draw nothing)."""
    from megadecode.sampling import sample_rows

    logits = torch.randn(4, 50, generator=gen(0)) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(greedy=True), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.7, top_p=0.8)]
    gens = [gen(1), None, gen(2), gen(3)]
    alone = [gen(1), None, gen(2), gen(3)]
    for _ in range(5):
        tokens, lps = sample_rows(logits, params, gens)
        for i, (p, g) in enumerate(zip(params, alone)):
            t, lp = sample(logits[i:i + 1], p, g)
            assert tokens[i].item() == t.item() and torch.equal(lps[i:i + 1], lp), i
    assert tokens[1].item() == logits[1].argmax().item()


def test_sample_rows_top_p_one_keeps_every_token():
    """A row without top_p next to a row with one is not cut: its threshold is inf, not 1.0, since the mass above
    a tiny last token can round to 1.0 (here: 0.5 + 0.5), which `before >= 1.0` would drop."""
    from megadecode.sampling import _select

    logits = torch.tensor([[0.0, 0.0, -30.0]] * 2)
    noise = torch.tensor([[1.0, 1.0, 1e-30]] * 2)  # the tiny token wins the race unless it is cut
    temperature = torch.ones(2, 1)
    assert _select(logits, temperature, torch.tensor([[0.5], [math.inf]]), noise).tolist() == [0, 2]
    assert _select(logits, temperature, torch.tensor([[0.5], [1.0]]), noise).tolist() == [0, 0]  # why inf


def test_sample_rows_checks_its_arguments():
    from megadecode.sampling import sample_rows

    with pytest.raises(ValueError, match="2 rows of logits need 2 params"):
        sample_rows(torch.zeros(2, 3), [SamplingParams()], [None])


# ---- top_k and min_p, against a plain torch reference on fixed logits ---------------------------------------------

# chi-square critical values at p = 0.001 for more degrees of freedom (the fixed logits below have up to 12 tokens)
CHI2_999_MORE = {**CHI2_999, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59, 11: 31.26}
FIXED = torch.tensor([2.0, -1.0, 0.5, 1.5, -0.3, 0.9, -2.0, 1.1, 0.0, -0.7, 1.8, 0.2])  # 12 distinct logits


def reference(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The distribution a draw must follow, written out plainly in float64 (vLLM's order: temperature, min_p,
    top_k, top_p on what is left)."""
    p = torch.softmax(logits.double() / temperature, -1)
    if min_p:
        p = torch.where(p < min_p * p.max(), 0.0, p)
    if top_k:
        kth = p.sort(descending=True).values[min(top_k, len(p)) - 1]
        p = torch.where(p < kth, 0.0, p)
    p = p / p.sum()
    if top_p < 1:
        order = p.argsort(descending=True)
        keep, mass = torch.zeros_like(p, dtype=torch.bool), 0.0
        for i in order.tolist():  # the smallest most-probable set whose mass reaches top_p
            keep[i] = True
            mass += p[i].item()
            if mass >= top_p:
                break
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p.tolist()


@pytest.mark.parametrize("kw", [
    {"top_k": 3}, {"top_k": 5, "temperature": 0.7}, {"min_p": 0.1}, {"min_p": 0.2, "temperature": 1.5},
    {"top_k": 6, "top_p": 0.8}, {"min_p": 0.05, "top_k": 8, "top_p": 0.9, "temperature": 1.2},
    {"top_k": 100},  # more than the vocabulary: every token
])
def test_top_k_and_min_p_draw_from_the_reference_distribution(kw):
    want = reference(FIXED, **kw)
    tokens, lps = sample(FIXED.expand(40000, -1).contiguous(), SamplingParams(**kw), gen(20))
    support = sum(1 for x in want if x > 0)
    assert set(tokens.tolist()) == {i for i, x in enumerate(want) if x > 0}  # never outside it, all of it drawn
    assert chi_square(tokens, want) < CHI2_999_MORE[support - 1]
    torch.testing.assert_close(lps, torch.log_softmax(FIXED, -1)[tokens])  # logprobs stay the model's (T = 1)


def test_top_k_keeps_ties_at_the_kth():
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])  # top_k 2: the k-th is tied three ways, all three stay
    tokens, _ = sample(logits.expand(20000, -1).contiguous(), SamplingParams(top_k=2), gen(21))
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    assert chi_square(tokens, reference(logits, top_k=2)) < CHI2_999_MORE[3]


def test_top_k_one_and_min_p_one_are_greedy():
    logits = torch.randn(256, 100, generator=gen(22))
    for p in (SamplingParams(top_k=1, temperature=2.0), SamplingParams(min_p=1.0, temperature=2.0)):
        assert torch.equal(sample(logits, p, gen(23))[0], logits.argmax(-1))


def test_sample_rows_with_top_k_and_min_p_equals_sample_row_by_row():
    """Rows that cut with top_k / min_p next to rows that do not: each as `sample` of it alone."""
    from megadecode.sampling import sample_rows

    logits = torch.randn(5, 60, generator=gen(24)) * 2
    params = [SamplingParams(top_k=4), SamplingParams(temperature=0.9), SamplingParams(min_p=0.3, top_p=0.9),
              SamplingParams(greedy=True, top_k=2), SamplingParams(top_k=7, min_p=0.01, temperature=1.4)]
    gens, alone = [gen(1), gen(2), gen(3), None, gen(5)], [gen(1), gen(2), gen(3), None, gen(5)]
    for _ in range(8):
        tokens, lps = sample_rows(logits, params, gens)
        for i, (p, g) in enumerate(zip(params, alone)):
            t, lp = sample(logits[i:i + 1], p, g)
            assert tokens[i].item() == t.item() and torch.equal(lps[i:i + 1], lp), i


@pytest.mark.parametrize("kw, text", [({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
                                      ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
                                      ({"min_p": math.nan}, "min_p")])
def test_invalid_top_k_and_min_p(kw, text):
    with pytest.raises(ValueError, match=text):
        SamplingParams(**kw)


def test_truncates():
    assert not SamplingParams().truncates and not SamplingParams(greedy=True, top_k=3).truncates
    assert all(SamplingParams(**kw).truncates for kw in ({"top_k": 3}, {"min_p": 0.1}, {"top_p": 0.9}))


# ---- logit_bias ----------------------------------------------------------------------------------------------

def test_logit_bias_moves_greedy_and_leaves_the_model_logprobs():
    from megadecode.sampling import sample_rows

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    p = SamplingParams(greedy=True, logit_bias=((2, 5.0),))
    toks, lp = sample(logits, p)
    assert toks.tolist() == [2, 2]
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[:, 2])  # the model's, not the biased ones
    # per row: only the first row biased (-100 bans its argmax), the second as it was
    toks, lp = sample_rows(logits, [SamplingParams(greedy=True, logit_bias=((0, -100.0),)),
                                    SamplingParams(greedy=True)], [None, None])
    assert toks.tolist() == [1, 1]


def test_logit_bias_draws_from_the_biased_distribution():
    """Temperature 0.7 over logits + bias against a plain torch reference: chi-square at p = 0.001."""
    probs = [0.1, 0.2, 0.3, 0.4]
    bias = ((0, 1.5), (3, -0.5))
    b = torch.zeros(4)
    for t, v in bias:
        b[t] += v
    want = torch.softmax((torch.tensor(probs).log() + b) / 0.7, -1).tolist()
    toks, _ = sample(rows(probs, 40000), SamplingParams(temperature=0.7, logit_bias=bias), gen(5))
    assert chi_square(toks, want) < CHI2_999[3]


def test_a_row_with_a_bias_draws_alone_what_it_draws_in_a_batch():
    from megadecode.sampling import sample_rows

    logits = torch.randn(3, 50, generator=gen(1))
    ps = [SamplingParams(temperature=0.9, logit_bias=((7, 3.0), (11, -2.0))), SamplingParams(temperature=1.2),
          SamplingParams(greedy=True, logit_bias=((40, 9.0),))]
    toks, lp = sample_rows(logits, ps, [gen(10), gen(11), None])
    for i in range(3):
        alone, alone_lp = sample(logits[i:i + 1], ps[i], gen(10 + i) if i < 2 else None)
        assert alone.item() == toks[i].item() and torch.allclose(alone_lp, lp[i:i + 1])
    assert toks[2].item() == 40


def test_logit_bias_is_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, math.nan),))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(torch.zeros(1, 4), SamplingParams(greedy=True, logit_bias=((4, 1.0),)))
    assert SamplingParams(greedy=True, logit_bias=((1, 1.0),)).truncates  # the in-step samplers do not bias


def test_generate_applies_logit_bias():
    from megadecode.engine import Engine

    e = Engine.from_pretrained("tiny-qwen3-moe", max_batch=1, max_seq_len=32)
    r = e.generate([[256, 5]], 4, SamplingParams(greedy=True, logit_bias=((65, 100.0),)), stop_at_eos=False)
    assert r.token_ids[0] == [65] * 4


# ---- presence, frequency and repetition penalties -------------------------------------------------------------

def _reference_penalties(logits, prompt, output, p: SamplingParams):
    """The penalties in plain torch, one row at a time (vLLM's definitions)."""
    x = logits.clone()
    counts = torch.zeros(x.shape[-1])
    for t in output:
        counts[t] += 1
    for t in range(x.shape[-1]):
        if t in prompt or counts[t] > 0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * float(counts[t] > 0)
    return x


def test_penalties_against_a_plain_torch_reference():
    from megadecode.sampling import Counts

    V = 12
    logits = torch.randn(2, V, generator=gen(3)) * 3
    prompts, outputs = [[1, 2, 2], [5]], [[2, 7, 7, 7], []]
    p = SamplingParams(greedy=True, presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.3)
    c = Counts(2, V, "cpu")
    c.start([0, 1], prompts)
    for r, out in enumerate(outputs):
        for t in out:
            c.add(torch.tensor([r]), torch.tensor([t]))
    toks, lp = sample(logits, p, counts=c)
    for r in range(2):
        want = _reference_penalties(logits[r], prompts[r], outputs[r], p)
        assert toks[r].item() == int(want.argmax())
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0])  # the model's


def test_frequency_penalty_draws_from_the_penalized_distribution():
    from megadecode.sampling import Counts

    probs = [0.1, 0.2, 0.3, 0.4]
    n = 40000
    c = Counts(n, 4, "cpu")
    c.start(range(n), [[0]] * n)
    c.add(torch.arange(n), torch.full((n,), 3))  # every row generated token 3 twice
    c.add(torch.arange(n), torch.full((n,), 3))
    p = SamplingParams(temperature=0.8, frequency_penalty=0.6, repetition_penalty=1.5)
    ref = _reference_penalties(torch.tensor(probs).log(), [0], [3, 3], p)
    want = torch.softmax(ref / 0.8, -1).tolist()
    toks, _ = sample(rows(probs, n), p, gen(9), counts=c)
    assert chi_square(toks, want) < CHI2_999[3]


def test_penalties_need_counts_and_are_checked():
    with pytest.raises(ValueError, match="token counts"):
        sample(torch.zeros(1, 4), SamplingParams(greedy=True, presence_penalty=1.0))
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
               {"repetition_penalty": math.inf}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    assert SamplingParams(greedy=True, repetition_penalty=1.1).truncates  # the in-step samplers do not penalize


def test_generate_with_penalties_repeats_less():
    """Engine.generate counts on the device: a strong frequency penalty keeps greedy off the tokens it made."""
    from megadecode.engine import Engine

    e = Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=48)
    plain = e.generate([[256, 5], [256, 9, 9]], 24, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    pen = e.generate([[256, 5], [256, 9, 9]], 24, SamplingParams(greedy=True, frequency_penalty=2.0,
                                                                 presence_penalty=2.0), stop_at_eos=False).token_ids
    for a, b in zip(plain, pen):
        assert len(set(b)) >= len(set(a)) and len(set(b)) > 12, (a, b)


# ---- min_tokens: stop ids banned before the minimum ---------------------------------------------------------------

def test_banned_tokens_are_never_drawn_and_the_logprobs_stay_the_models():
    from megadecode.sampling import sample_rows

    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 0.0, 9.0]])
    toks, lp = sample(logits, SamplingParams(greedy=True), ban=[(0,), (2,)])
    assert toks.tolist() == [1, 0]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0])
    many = rows([0.05, 0.9, 0.05], 4000)
    toks, _ = sample_rows(many, [SamplingParams(temperature=1.0)] * 4000, [gen(i) for i in range(4000)],
                          ban=[(1,)] * 4000)
    assert (toks != 1).all() and chi_square(toks, [0.5, 0.0, 0.5]) < CHI2_999[1]


def test_generate_min_tokens_holds_eos_back():
    """EOS forced by a bias: without min_tokens the first token ends the sequence; with 5, the sixth does."""
    from megadecode.engine import Engine, RequestError

    e = Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=48)
    eos = e.cfg.eos_token_id[0]
    p = SamplingParams(greedy=True, logit_bias=((eos, 100.0),))
    assert e.generate([[256, 5]], 10, p).token_ids == [[eos]]
    out = e.generate([[256, 5], [256, 7, 7]], 10, p, min_tokens=5).token_ids
    assert all(len(r) == 6 and r[-1] == eos and eos not in r[:-1] for r in out), out
    assert len(e.generate([[256, 5]], 10, p, min_tokens=5, stop_at_eos=False).token_ids[0]) == 10
    with pytest.raises(RequestError, match="min_tokens"):
        e.generate([[256, 5]], 3, p, min_tokens=4)
