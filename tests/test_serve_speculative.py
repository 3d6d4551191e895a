"""`megadecode serve --speculative ngram`: decode steps verify prompt-lookup drafts (ModelRunner.verify); greedy
completions are the tokens the engine generates alone, sampled ones run to their length, sequences that cannot
take drafts (penalties, structured output, top logprobs) are served as before, and /metrics counts the drafts."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import concurrent.futures as cf

import pytest

from megadecode.serve.server import Server
from megadecode.speculative import NgramDrafter
from serving import MAX_SEQ, QWEN, Running, alone, ids


@pytest.fixture(scope="module")
def spec():
    r = Running(Server.build(QWEN, max_batch=4, max_seq_len=MAX_SEQ, drafter=NgramDrafter(4)))
    yield r
    r.close()


def test_greedy_completions_with_drafts_are_the_engines_own(spec):
    prompts = ["abcabcabcabcabc", "xyxyxyxyxyxy", "Hello", "la la la la la la"]
    client = spec.client()

    def one(p):
        return client.completions.create(model=QWEN, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})

    with cf.ThreadPoolExecutor(4) as pool:  # batched together, with different accepted lengths
        outs = list(pool.map(one, prompts))
    for p, out in zip(prompts, outs):
        assert out.choices[0].token_ids == alone(ids(p), 24, eos=False).token_ids[0], p
    assert spec.metric("megadecode_spec_draft_tokens_total") > 0
    assert spec.metric("megadecode_spec_accepted_tokens_total") > 0


def test_sequences_that_take_no_drafts_are_served_as_before(spec):
    client = spec.client()
    out = client.completions.create(model=QWEN, prompt="abababababab", max_tokens=12, temperature=0.9, seed=1, n=2,
                                    extra_body={"ignore_eos": True})
    assert [len(c.text.encode("utf-8", "surrogatepass")) > 0 for c in out.choices] == [True, True]
    assert out.usage.completion_tokens == 24
    pen = client.completions.create(model=QWEN, prompt="abcabcabc", max_tokens=8, temperature=0,
                                    presence_penalty=1.5, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(pen.choices[0].token_ids) == 8
    lp = client.completions.create(model=QWEN, prompt="abcabcabc", max_tokens=6, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    assert lp.choices[0].token_ids == alone(ids("abcabcabc"), 6, eos=False).token_ids[0]
    assert len(lp.choices[0].logprobs.top_logprobs) == 6  # a step's alternatives each (byte texts may merge keys)
    pytest.importorskip("xgrammar")
    g = client.completions.create(model=QWEN, prompt="abab", max_tokens=20, temperature=0.7, seed=2,
                                  extra_body={"guided_choice": ["abab", "ba"]})
    assert g.choices[0].text in ("abab", "ba") and g.choices[0].finish_reason == "stop"


def test_models_with_kda_layers_serve_drafts_with_their_own_greedy_tokens():
    """tiny-k3 (KDA layers): two sequences batched with drafts, some rejected, whose recurrent state is rewound to
    the accepted prefix (ModelRunner.verify): the greedy completions are the engine's own."""
    from megadecode.engine import Engine
    from megadecode.sampling import SamplingParams

    r = Running(Server.build("tiny-k3", max_batch=2, max_seq_len=MAX_SEQ, drafter=NgramDrafter(3)))
    try:
        client = r.client()
        prompts = ["abcabcabcabc", "xyzzxyzzxyzz"]

        def one(p):
            return client.completions.create(model="tiny-k3", prompt=p, max_tokens=20, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})

        with cf.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(one, prompts))
        eng = Engine.from_pretrained("tiny-k3", max_batch=1, max_seq_len=MAX_SEQ)
        for p, out in zip(prompts, outs):
            want = eng.generate([list(ids(p))], 20, SamplingParams(greedy=True), stop_at_eos=False).token_ids[0]
            assert out.choices[0].token_ids == want, p
        assert r.metric("megadecode_spec_draft_tokens_total") > r.metric("megadecode_spec_accepted_tokens_total")
    finally:
        r.close()


def test_a_draft_model_drafts_for_the_server(capsys):
    """`serve --speculative draft --draft-model M`: greedy completions are still the engine's own; the draft model
    (here the target itself: every draft accepted) proposes for two sequences batched together."""
    from megadecode.speculative import draft_model_drafter
    from test_cli import fails

    drafter = draft_model_drafter(QWEN, 3, 259, device="cpu", dtype="float32", seed=0, max_batch=2,
                                  max_seq_len=MAX_SEQ)
    r = Running(Server.build(QWEN, max_batch=2, max_seq_len=MAX_SEQ, drafter=drafter))
    try:
        client = r.client()

        def one(p):
            return client.completions.create(model=QWEN, prompt=p, max_tokens=20, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})

        prompts = ["Hello there", "12345"]
        with cf.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(one, prompts))
        for p, out in zip(prompts, outs):
            assert out.choices[0].token_ids == alone(ids(p), 20, eos=False).token_ids[0], p
        drafted = r.metric("megadecode_spec_draft_tokens_total")
        assert drafted > 0 and r.metric("megadecode_spec_accepted_tokens_total") >= 0.9 * drafted
    finally:
        r.close()
    assert "--speculative draft needs --draft-model" in fails(capsys, ["serve", "--speculative", "draft"])
    assert "--draft-model needs --speculative draft" in fails(capsys, ["serve", "--draft-model", QWEN])


def test_the_mtp_layer_drafts_for_the_server(capsys):
    """`serve --speculative mtp` (Server.build mtp_draft_tokens): the MTP drafter is given the prefills' hidden
    states (two choices of one prompt share a prefill, copied into the second's slot) and the verify steps';
    greedy completions are the engine's own, batched with different lengths; a model without an MTP layer is
    refused in one line."""
    from megadecode.engine import Engine
    from megadecode.sampling import SamplingParams
    from test_cli import fails

    mtp = "tiny-deepseek-v3-mtp"
    r = Running(Server.build(mtp, max_batch=3, max_seq_len=MAX_SEQ, mtp_draft_tokens=3))
    try:
        client = r.client()

        def one(p):
            return client.completions.create(model=mtp, prompt=p, max_tokens=20, temperature=0, n=2 if p == "ab" else 1,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})

        prompts = ["Hello there", "ab"]
        with cf.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(one, prompts))
        eng = Engine.from_pretrained(mtp, max_batch=1, max_seq_len=MAX_SEQ)
        for p, out in zip(prompts, outs):
            want = eng.generate([list(ids(p))], 20, SamplingParams(greedy=True), stop_at_eos=False).token_ids[0]
            assert [c.token_ids for c in out.choices] == [want] * len(out.choices), p
        assert r.metric("megadecode_spec_draft_tokens_total") > 0
    finally:
        r.close()
    err = fails(capsys, ["serve", "--model", "tiny-deepseek-v3", "--speculative", "mtp"])
    assert "--speculative mtp: the MTP drafter needs a model with a multi-token-prediction layer" in err
