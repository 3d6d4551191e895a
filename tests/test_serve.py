"""`megadecode serve` over real HTTP on localhost (tests/serving.py), tiny-qwen3-moe with the torch executor on the
CPU: the openai client, streaming and not; concurrent requests get exactly the greedy tokens each gets alone
(Engine.generate is the oracle); seeded sampling, stop strings and ids, logprobs; a bounded load test; a checkpoint's
chat template. Bad input: tests/test_serve_input.py; backpressure, disconnects, failures, the command:
tests/test_serve_faults.py."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import asyncio
import json
import random
import time

import httpx
import pytest

from megadecode.engine import Engine
from megadecode.sampling import SamplingParams
from megadecode.serve.chat import render_fallback
from megadecode.serve.server import Server
from megadecode.tokenizer import BOS_ID
from serving import (  # noqa: F401 (srv: a fixture)
    MAX_SEQ, QWEN, TOK, Running, alone, check_greedy, complete, ids, post, srv,
)


# ---- the OpenAI API ---------------------------------------------------------------------------------------------

def test_models_health_metrics(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [QWEN]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    text = httpx.get(srv.url + "/metrics").text
    for name in ("megadecode_requests_total", "megadecode_prompt_tokens_total", "megadecode_generation_tokens_total",
                 "megadecode_batch_occupancy", "megadecode_running_requests", "megadecode_waiting_requests",
                 "megadecode_step_seconds_bucket", "megadecode_time_to_first_token_seconds_bucket",
                 "megadecode_cold_start_seconds"):
        assert name in text, name
    assert srv.metric("megadecode_cold_start_seconds") > 0  # process start to the startup request's first token


def test_completion_is_the_greedy_generation(srv):
    r = complete(srv, prompt="Hello", max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    want = alone(ids("Hello"), 12)
    choice = r.choices[0]
    assert choice.token_ids == want.token_ids[0]
    assert choice.text == TOK.decode(want.token_ids[0])
    assert choice.finish_reason == ("stop" if len(want.token_ids[0]) < 12 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, len(want.token_ids[0]))
    assert r.object == "text_completion" and r.model == QWEN and r.id.startswith("cmpl-")
    check_greedy(srv)


def test_prompt_as_token_ids(srv):
    prompt = [BOS_ID, 3, 200, 17]
    r = complete(srv, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
    assert r.choices[0].token_ids == alone(tuple(prompt), 6, eos=False).token_ids[0]
    assert r.choices[0].finish_reason == "length"


def test_streaming_matches_the_whole_response(srv):
    kw = dict(prompt="Stream me", max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    whole = complete(srv, **kw).choices[0]
    chunks = list(complete(srv, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(whole.token_ids)
    body = [c.choices[0] for c in chunks[:-1]]
    assert "".join(c.text for c in body) == whole.text
    assert sum((c.token_ids for c in body), []) == whole.token_ids
    assert [c.finish_reason for c in body][-1] == whole.finish_reason
    assert all(c.finish_reason is None for c in body[:-1])


def test_chat_with_the_fallback_template(srv):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = (BOS_ID, *TOK.encode(render_fallback(messages), add_bos=False))
    want = alone(prompt, 8, eos=False).token_ids[0]
    client = srv.client()
    r = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].token_ids == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == TOK.decode(want)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=QWEN, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TOK.decode(want)
    assert chunks[-1].choices[0].finish_reason == "length"


def at_once(srv, reqs: list[tuple[dict, bool]]) -> list[list[int]]:
    """Completions sent concurrently through the async openai client, each (its keyword arguments, streamed or
    not): the token ids each got."""
    async def one(client, kw, stream):
        if not stream:
            return (await client.completions.create(model=QWEN, **kw)).choices[0].token_ids
        out = []
        async for c in await client.completions.create(model=QWEN, stream=True, **kw):
            out += c.choices[0].token_ids or [] if c.choices else []
        return out

    async def main():
        client = srv.async_client()
        return await asyncio.gather(*(one(client, kw, stream) for kw, stream in reqs))

    return asyncio.run(main())


def test_concurrent_requests_get_the_tokens_each_gets_alone(srv):
    """16 requests at once (twice the batch: some wait for a slot), different prompts and lengths, half of them
    streamed: every one gets exactly its greedy tokens alone."""
    rng = random.Random(0)
    reqs = [(tuple([BOS_ID] + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]), rng.randrange(1, 16), i % 2)
            for i in range(16)]
    got = at_once(srv, [(dict(prompt=list(p), max_tokens=n, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True}), stream)
                        for p, n, stream in reqs])
    for (prompt, n, _), tokens in zip(reqs, got):
        assert tokens == alone(prompt, n, eos=False).token_ids[0], prompt


def test_seeded_sampling(srv):
    kw = dict(prompt="Roll", max_tokens=10, temperature=0.8, top_p=0.9, seed=1234,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = (complete(srv, **kw).choices[0].token_ids for _ in range(2))
    c = complete(srv, **{**kw, "seed": 1235}).choices[0].token_ids
    want = alone(ids("Roll"), 10, False, SamplingParams(temperature=0.8, top_p=0.9), 1234).token_ids[0]
    assert a == b == want and c != a


def test_n_choices_each_draw_what_their_seed_draws_alone(srv):
    """n > 1: choice i of a seeded request is what Engine.generate alone draws with seed + i (one prefill of the
    prompt serves them all), whole or streamed (every chunk names its choice), the usage counting the prompt once
    and every choice's tokens; with logprobs each choice has its own."""
    params = SamplingParams(temperature=0.9)
    want = [alone(ids("Roll"), 6, False, params, 500 + i).token_ids[0] for i in range(3)]
    assert len({tuple(w) for w in want}) > 1
    kw = dict(prompt="Roll", max_tokens=6, temperature=0.9, seed=500, n=3, logprobs=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    srv.wait_idle()
    before = [srv.metric("megadecode_prompt_tokens_total"), srv.metric("megadecode_requests_total", 'outcome="length"')]
    r = complete(srv, **kw)
    srv.wait_idle()
    after = [srv.metric("megadecode_prompt_tokens_total"), srv.metric("megadecode_requests_total", 'outcome="length"')]
    assert [a - b for a, b in zip(after, before)] == [len(ids("Roll")), 3]  # the prompt once, each choice finished
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == want
    assert all(len(c.logprobs.token_logprobs) == 6 for c in r.choices)
    assert r.usage.prompt_tokens == len(ids("Roll")) and r.usage.completion_tokens == 18
    got = [[] for _ in range(3)]
    done = set()
    for chunk in complete(srv, **kw, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            got[c.index] += c.token_ids or []
            if c.finish_reason is not None:
                done.add(c.index)
    assert got == want and done == {0, 1, 2}
    chat = srv.client().chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, n=2, temperature=0, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    srv.wait_idle()


def test_a_choice_that_hits_a_stop_string_ends_alone(srv):
    """n = 2, a stop string in choice 0's text only: choice 0 ends before it (finish "stop", nothing after it even
    when the engine had queued a later step), choice 1 runs to max_tokens, both streamed and not."""
    params = SamplingParams(temperature=0.9)
    texts = [TOK.decode(alone(ids("Roll"), 12, False, params, 700 + i).token_ids[0]) for i in range(2)]
    stop = next(texts[0][k:k + 2] for k in range(2, len(texts[0]) - 2) if texts[0][k:k + 2] not in texts[1])
    want = [texts[0][:texts[0].index(stop)], texts[1]]
    kw = dict(prompt="Roll", max_tokens=12, temperature=0.9, seed=700, n=2, stop=[stop],
              extra_body={"ignore_eos": True})
    r = complete(srv, **kw)
    assert [c.text for c in r.choices] == want and [c.finish_reason for c in r.choices] == ["stop", "length"]
    got, reasons = ["", ""], [None, None]
    for chunk in complete(srv, **kw, stream=True):
        for c in chunk.choices:
            assert reasons[c.index] is None  # nothing after a choice's last chunk
            got[c.index] += c.text
            reasons[c.index] = c.finish_reason
    assert got == want and reasons == ["stop", "length"]
    srv.wait_idle()


@pytest.mark.parametrize("kw", [{"top_k": 5}, {"min_p": 0.2}, {"top_k": 8, "min_p": 0.05, "top_p": 0.9}])
def test_seeded_top_k_and_min_p(srv, kw):
    """vLLM's top_k and min_p, on the device in the server's sampler: a seeded request gets what Engine.generate
    alone draws with the same parameters and seed."""
    body = dict(prompt="Roll", max_tokens=10, temperature=1.3, seed=77, top_p=kw.get("top_p", 1.0),
                extra_body={"return_token_ids": True, "ignore_eos": True,
                            **{k: v for k, v in kw.items() if k != "top_p"}})
    got = complete(srv, **body).choices[0].token_ids
    want = alone(ids("Roll"), 10, False, SamplingParams(temperature=1.3, **kw), 77).token_ids[0]
    unc = alone(ids("Roll"), 10, False, SamplingParams(temperature=1.3), 77).token_ids[0]
    assert got == want and want != unc  # the cut changes what is drawn


def test_top_k_one_is_greedy(srv):
    r = complete(srv, prompt="Hello", max_tokens=12, temperature=1.5, extra_body={"top_k": 1, "return_token_ids": True})
    assert r.choices[0].token_ids == alone(ids("Hello"), 12).token_ids[0]


def test_penalties_get_what_generate_alone_gets_batched_or_not(srv):
    """presence, frequency (OpenAI's) and repetition (vLLM's) penalties: the server counts each request's tokens
    per slot on the device, Engine.generate per row; 12 requests at once, greedy and seeded, half of them
    penalized and half streamed, each gets exactly what it gets alone."""
    rng = random.Random(5)
    pens = [{"presence_penalty": 0.8, "frequency_penalty": 1.2}, {"repetition_penalty": 1.4},
            {"frequency_penalty": -0.5, "repetition_penalty": 0.9}, {}]
    reqs = [(tuple([BOS_ID] + [rng.randrange(256) for _ in range(rng.randrange(2, 12))]), rng.randrange(4, 16),
             pens[i % 4], 0.0 if i % 3 else 0.9, i % 2) for i in range(12)]

    got = at_once(srv, [(dict(prompt=list(p), max_tokens=n, temperature=t, seed=11,
                              presence_penalty=pen.get("presence_penalty", 0),
                              frequency_penalty=pen.get("frequency_penalty", 0),
                              extra_body={"return_token_ids": True, "ignore_eos": True,
                                          "repetition_penalty": pen.get("repetition_penalty", 1)}), stream)
                        for p, n, pen, t, stream in reqs])
    for (prompt, n, pen, temp, _), tokens in zip(reqs, got):
        params = SamplingParams(greedy=True, **pen) if temp == 0 else SamplingParams(temperature=temp, **pen)
        assert tokens == alone(prompt, n, False, params, 11).token_ids[0], (prompt, pen, temp)
    assert any(alone(p, n, False, SamplingParams(greedy=True, **pen)).token_ids[0]
               != alone(p, n, False).token_ids[0] for p, n, pen, t, _ in reqs if pen and t == 0)  # they bite


def test_min_tokens_holds_the_stop_ids_back(srv):
    """EOS forced by a bias (the tiny model's 257): without min_tokens it ends the completion at once; with 4, the
    fifth token; a stop id counts alike."""
    eos = 257
    kw = dict(prompt="Hello", max_tokens=10, temperature=0, logit_bias={str(eos): 100})
    r = complete(srv, **kw, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [eos] and r.choices[0].finish_reason == "stop"
    r = complete(srv, **kw, extra_body={"return_token_ids": True, "min_tokens": 4})
    ids_ = r.choices[0].token_ids
    assert len(ids_) == 5 and ids_[-1] == eos and eos not in ids_[:-1] and r.choices[0].finish_reason == "stop"
    r = complete(srv, prompt="Hello", max_tokens=10, temperature=0, logit_bias={"66": 100},
                 extra_body={"return_token_ids": True, "stop_token_ids": [66], "min_tokens": 3, "ignore_eos": True})
    assert r.choices[0].token_ids[-1] == 66 and len(r.choices[0].token_ids) == 4


def test_logit_bias_through_the_openai_client(srv):
    """A bias of +100 on one token makes greedy pick it every step; -100 on the greedy token moves the first pick."""
    r = complete(srv, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"65": 100},
                 extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == [65] * 4 and r.choices[0].text == "AAAA"
    first = alone(ids("Hello"), 1).token_ids[0][0]
    r = complete(srv, prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(first): -100},
                 extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids[0] != first


def test_stop_strings_and_stop_ids(srv):
    full = complete(srv, prompt="Hello", max_tokens=16, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    # a stop id: the sequence ends with that token (kept, as EOS is)
    r = complete(srv, prompt="Hello", max_tokens=16, temperature=0,
                 extra_body={"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [full.token_ids[4]]})
    cut = full.token_ids.index(full.token_ids[4]) + 1
    assert r.choices[0].token_ids == full.token_ids[:cut] and r.choices[0].finish_reason == "stop"
    # a stop string: the text ends before it, streamed or not
    text = full.text
    k = next(i for i in range(2, len(text) - 2) if text[i:i + 2].isprintable() and text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    srv.wait_idle()
    outcomes = [srv.metric("megadecode_requests_total", f'outcome="{o}"') for o in ("stop", "abort")]
    r = complete(srv, prompt="Hello", max_tokens=16, temperature=0, stop=[stop, "never seen \x00"],
                 extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    streamed = list(complete(srv, prompt="Hello", max_tokens=16, temperature=0, stop=stop, stream=True,
                             extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    srv.wait_idle()  # both counted as what they answered, stop, not as aborted
    assert [srv.metric("megadecode_requests_total", f'outcome="{o}"') for o in ("stop", "abort")] == \
        [outcomes[0] + 2, outcomes[1]]


def test_logprobs(srv):
    r = complete(srv, prompt="Hello", max_tokens=5, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    want = alone(ids("Hello"), 5, eos=False)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, want.logprobs[0]))
    c = srv.client().chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                             logprobs=True, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.content) == 3 and all(t.logprob <= 0 for t in c.choices[0].logprobs.content)


def test_top_logprobs_are_the_models_most_likely_tokens(srv):
    """Completions' integer logprobs and chat's top_logprobs: per generated token, that many alternatives, most
    likely first, each the model's log-softmax at that position (the oracle: a prefill of the prompt and the tokens
    before it), streamed or not; with greedy decoding the first alternative is the token drawn."""
    import torch

    from serving import oracle

    def model_top(prompt: list[int], out: list[int], k: int) -> list[list[tuple[int, float]]]:
        eng, rows = oracle(), []
        for i in range(len(out)):
            lp = torch.log_softmax(eng.prefill([list(prompt) + out[:i]]).float()[0], -1)
            vals, top = lp.topk(k)
            rows.append(list(zip(top.tolist(), vals.tolist())))
        return rows

    for stream in (False, True):
        r = post(srv, {"model": QWEN, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 5,
                       "return_token_ids": True, "ignore_eos": True, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            choices = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
            toks = [t for c in choices for t in c["token_ids"]]
            tops = [t for c in choices if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
        else:
            choice = r.json()["choices"][0]
            toks, tops = choice["token_ids"], choice["logprobs"]["top_logprobs"]
        want = model_top(ids("Hello"), toks, 5)
        assert len(tops) == len(toks) == 4
        for got, w, t in zip(tops, want, toks):
            pieces = [TOK.decode([a]) for a, _ in w]  # a {piece: logprob} dict: pieces that decode alike share a key
            first = {}
            for p, (_, lp) in zip(pieces, w):
                first.setdefault(p, lp)  # the likelier one's
            assert list(got) == list(first) and all(abs(got[p] - lp) < 1e-4 for p, lp in first.items())
            assert w[0][0] == t  # greedy: the most likely token is the one drawn
    c = srv.client().chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                             logprobs=True, top_logprobs=3, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and lps[0] == pytest.approx(t.logprob, abs=1e-6)
        assert t.top_logprobs[0].token == t.token and all(a.bytes == list(a.token.encode()) for a in t.top_logprobs)
    none = post(srv, {"model": QWEN, "prompt": "Hello", "max_tokens": 2, "logprobs": 0})
    assert none.json()["choices"][0]["logprobs"]["top_logprobs"] is None  # 0: the drawn tokens' only


# ---- a bounded load test ------------------------------------------------------------------------------------------

def test_load_every_request_answered(srv):
    """300 requests, 32 at a time (the batch holds 8: the rest queue), streamed and not, of 1 to 8 tokens: every
    one is answered with all its tokens, none lost; a sample is checked token for token."""
    rng = random.Random(3)
    reqs = [([BOS_ID] + [rng.randrange(256) for _ in range(rng.randrange(1, 24))], rng.randrange(1, 9),
             rng.random() < .5) for _ in range(300)]
    before = srv.metric("megadecode_requests_total", 'outcome="length"')

    async def one(client, sem, prompt, n, stream):
        body = {"model": QWEN, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream,
                "ignore_eos": True, "return_token_ids": True}
        async with sem:
            if not stream:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            tokens, done = [], False
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            assert done
            return tokens

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, sem, *r) for r in reqs))

    t = time.perf_counter()
    got = asyncio.run(main())
    elapsed = time.perf_counter() - t
    assert [len(g) for g in got] == [n for _, n, _ in reqs]
    for k in random.Random(4).sample(range(len(reqs)), 12):
        assert got[k] == alone(tuple(reqs[k][0]), reqs[k][1], eos=False).token_ids[0]
    assert srv.metric("megadecode_requests_total", 'outcome="length"') == before + 300
    srv.wait_idle()
    assert srv.metric("megadecode_running_requests") == 0 and srv.metric("megadecode_waiting_requests") == 0
    print(f"300 requests in {elapsed:.1f} s")


# ---- a checkpoint's own tokenizer and chat template --------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_hf_tokenizer(directory) -> None:
    """A byte-level BPE tokenizer without merges: 256 byte tokens + 3 special ones = the tiny presets' 259 ids,
    with a ChatML-like chat template, written as transformers writes tokenizers (tokenizer.json, its config and
    chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    assert len(fast) == 259
    fast.save_pretrained(str(directory))


def test_chat_uses_the_checkpoint_template(tiny_ckpt):
    from transformers import AutoTokenizer

    ckpt = tiny_ckpt(QWEN)
    write_hf_tokenizer(ckpt)
    hf = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo"}]
    prompt = hf.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)
    assert prompt[0] == hf.convert_tokens_to_ids("<|im_start|>")
    r = Running(Server.build(str(ckpt), max_batch=2, max_seq_len=MAX_SEQ))
    try:
        out = r.client().chat.completions.create(model=str(ckpt), messages=messages, max_tokens=6, temperature=0,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        eng = Engine.from_pretrained(str(ckpt), max_batch=1, max_seq_len=MAX_SEQ)
        want = eng.generate([prompt], 6, SamplingParams(greedy=True), stop_at_eos=False).token_ids[0]
        assert out.usage.prompt_tokens == len(prompt) and out.choices[0].token_ids == want
        assert out.choices[0].message.content == hf.decode(want, skip_special_tokens=True)
        bad = post(r, {"model": str(ckpt), "messages": [{"role": "user", "content": "x"}], "max_tokens": 60},
                   "/v1/chat/completions")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    finally:
        r.close()
