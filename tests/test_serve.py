"""`megadecode serve` over real HTTP on localhost (tests/serving.py), tiny-qwen3-moe with the torch executor on the
CPU: the openai client, streaming and not; concurrent requests get exactly the greedy tokens each gets alone
(Engine.generate is the oracle); bad input is a 400 with an OpenAI-style body and never hurts the server; a full
queue is a 429; a client that leaves frees its slot; a failing request fails alone; a bounded load test."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import threading
import time

import httpx
import openai
import pytest

from megadecode.engine import Engine
from megadecode.sampling import SamplingParams
from megadecode.serve.chat import render_fallback
from megadecode.serve.server import Server
from megadecode.tokenizer import BOS_ID, ByteTokenizer
from serving import Running

QWEN = "tiny-qwen3-moe"
MAX_SEQ = 64
TOK = ByteTokenizer()


@functools.lru_cache(maxsize=None)
def oracle() -> Engine:
    return Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=MAX_SEQ)


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple, n: int, eos: bool = True, params=SamplingParams(greedy=True), seed: int = 0):
    return oracle().generate([list(prompt)], n, params, seed=seed, stop_at_eos=eos)


@pytest.fixture(scope="module")
def srv():
    r = Running(Server.build(QWEN, max_batch=8, max_seq_len=MAX_SEQ, max_queue=1000))
    yield r
    r.close()


def ids(text: str) -> tuple:
    return tuple(TOK.encode(text))


def complete(srv, **kw):
    kw.setdefault("model", QWEN)
    return srv.client().completions.create(**kw)


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


def test_concurrent_requests_get_the_tokens_each_gets_alone(srv):
    """16 requests at once (twice the batch: some wait for a slot), different prompts and lengths, half of them
    streamed: every one gets exactly its greedy tokens alone."""
    rng = random.Random(0)
    reqs = [(tuple([BOS_ID] + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]), rng.randrange(1, 16), i % 2)
            for i in range(16)]

    async def one(client, prompt, n, stream):
        kw = dict(model=QWEN, prompt=list(prompt), max_tokens=n, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        if not stream:
            return (await client.completions.create(**kw)).choices[0].token_ids
        out = []
        async for c in await client.completions.create(stream=True, **kw):
            out += c.choices[0].token_ids or [] if c.choices else []
        return out

    async def main():
        client = srv.async_client()
        return await asyncio.gather(*(one(client, *r) for r in reqs))

    got = asyncio.run(main())
    for (prompt, n, _), tokens in zip(reqs, got):
        assert tokens == alone(prompt, n, eos=False).token_ids[0], prompt


def test_seeded_sampling(srv):
    kw = dict(prompt="Roll", max_tokens=10, temperature=0.8, top_p=0.9, seed=1234,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = (complete(srv, **kw).choices[0].token_ids for _ in range(2))
    c = complete(srv, **{**kw, "seed": 1235}).choices[0].token_ids
    want = alone(ids("Roll"), 10, False, SamplingParams(temperature=0.8, top_p=0.9), 1234).token_ids[0]
    assert a == b == want and c != a


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
    r = complete(srv, prompt="Hello", max_tokens=16, temperature=0, stop=[stop, "never seen \x00"],
                 extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    streamed = list(complete(srv, prompt="Hello", max_tokens=16, temperature=0, stop=stop, stream=True,
                             extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(srv):
    r = complete(srv, prompt="Hello", max_tokens=5, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    want = alone(ids("Hello"), 5, eos=False)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, want.logprobs[0]))
    c = srv.client().chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                             logprobs=True, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.content) == 3 and all(t.logprob <= 0 for t in c.choices[0].logprobs.content)


# ---- bad input ----------------------------------------------------------------------------------------------------

def post(srv, body, path="/v1/completions", client=httpx):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(srv.url + path, content=data, headers={"content-type": "application/json"}, timeout=30)


OK = {"model": QWEN, "prompt": "Hi", "max_tokens": 2}
BAD = [
    (b"{not json", None, "not valid JSON"),
    (b'{"model": "tiny-qwen3-moe", "prompt": "Hi", "temperature": NaN}', None, "NaN is not JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b"", None, "not valid JSON"),
    ({**OK, "model": "gpt-4"}, "model", "'gpt-4' is not served here"),
    ({"prompt": "Hi"}, "model", "None is not served here"),
    ({**OK, "prompt": "x" * 60, "max_tokens": 10}, "max_tokens", "at most 3 new tokens fit"),
    ({**OK, "prompt": "x" * 80}, "prompt", "context is 64"),
    ({**OK, "max_tokens": 0}, "max_tokens", ">= 1, got 0"),
    ({**OK, "max_tokens": -5}, "max_tokens", ">= 1"),
    ({**OK, "max_tokens": 64}, "max_tokens", "at most 61 new tokens fit"),
    ({**OK, "max_tokens": "3"}, "max_tokens", "must be an integer"),
    ({**OK, "max_tokens": True}, "max_tokens", "must be an integer"),
    ({**OK, "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({**OK, "temperature": -0.5}, "temperature", "in [0, 2.0]"),
    ({**OK, "temperature": 7}, "temperature", "in [0, 2.0]"),
    ({**OK, "temperature": "hot"}, "temperature", "must be a number"),
    ({**OK, "top_p": 0}, "top_p", "(0, 1]"),
    ({**OK, "top_p": 1.5}, "top_p", "(0, 1]"),
    ({**OK, "seed": -1}, "seed", "in [0, 4294967295]"),
    ({**OK, "seed": 2**70}, "seed", "in [0, 4294967295]"),
    ({**OK, "prompt": [256, 259]}, "prompt", "token id 259, outside the vocabulary [0, 259)"),
    ({**OK, "prompt": [-1]}, "prompt", "token id -1"),
    ({**OK, "prompt": [1, 2.0]}, "prompt", "not a token id"),
    ({**OK, "prompt": []}, "prompt", "empty"),
    ({**OK, "prompt": ""}, "prompt", "empty"),
    ({**OK, "prompt": None}, "prompt", "must be a string or a list of token ids"),
    ({**OK, "prompt": {"a": 1}}, "prompt", "must be a string"),
    ({**OK, "prompt": ["a", "b"]}, "prompt", "one per request"),
    ({**OK, "n": 2}, "n", "not supported"),
    ({**OK, "echo": True}, "echo", "not supported"),
    ({**OK, "logprobs": 3}, "logprobs", "in [0, 0]"),
    ({**OK, "stop": ""}, "stop", "non-empty string"),
    ({**OK, "stop": [1]}, "stop", "non-empty string"),
    ({**OK, "stop": ["a"] * 17}, "stop", "at most 16"),
    ({**OK, "stop_token_ids": [300]}, "stop_token_ids", "outside the vocabulary"),
    ({**OK, "stream": "yes"}, "stream", "true or false"),
    ({**OK, "stream_options": [1]}, "stream_options", "must be an object"),
]


@pytest.mark.parametrize("body, param, text", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_400s_naming_the_field(srv, body, param, text):
    r = post(srv, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and text in err["message"], err


CHAT_BAD = [
    ({"model": QWEN}, "messages", "non-empty list"),
    ({"model": QWEN, "messages": []}, "messages", "non-empty list"),
    ({"model": QWEN, "messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"model": QWEN, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"model": QWEN, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
    ({"model": QWEN, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "only text parts"),
    ({"model": QWEN, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", ">= 1"),
    ({"model": QWEN, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
     "top_logprobs", "not supported"),
]


@pytest.mark.parametrize("body, param, text", CHAT_BAD, ids=[str(i) for i in range(len(CHAT_BAD))])
def test_bad_chat_requests(srv, body, param, text):
    r = post(srv, body, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_chat_content_parts_and_default_max_tokens(srv):
    r = post(srv, {"model": QWEN, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                   "temperature": 0, "ignore_eos": True}, "/v1/chat/completions")
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["total_tokens"] == MAX_SEQ  # no max_tokens: the rest of the context


def test_routes_and_methods_answer_in_the_openai_shape(srv):
    r = httpx.get(srv.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_too_large(srv):
    r = post(srv, b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]


def test_fuzzed_bodies_never_crash_the_server(srv):
    """Random JSON values in every field a request has (seeded): each answer is a 200 or a 400, never a 500,
    and the server still answers a good request exactly afterwards."""
    rng = random.Random(int(os.environ.get("MEGADECODE_FUZZ_SEED", 7)))
    values = [None, True, False, 0, 1, -1, 2**63, 1e308, -1e-9, 0.5, "", "x", "\x00\ud7ff", [], [1], [[1]], [-3],
              {}, {"a": []}, [None], ["a", 1], 3.0, 258, 259, [256] * 70, {"include_usage": 1},
              [{"role": "user"}], [{"role": "assistant", "content": None}], [{"content": "x"}],
              [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
              [{"role": "user", "content": "x" * 100}], [{"role": "tool", "content": ""}]]
    keys = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
            "logprobs", "stop_token_ids", "ignore_eos", "stream_options", "max_completion_tokens", "echo"]
    client = httpx.Client()
    for i in range(int(os.environ.get("MEGADECODE_FUZZ_N", 1000))):
        body = {"model": QWEN, "prompt": "Hi", "max_tokens": 2} if i % 3 else {}
        for k in rng.sample(keys, rng.randrange(1, 5)):
            body[k] = rng.choice(values)
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        r = post(srv, body, path, client)
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        if r.status_code == 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health").status_code == 200
    test_completion_is_the_greedy_generation(srv)


# ---- backpressure, disconnects, failures ------------------------------------------------------------------------

@pytest.fixture
def small():
    """One slot, two waiting places; decode steps wait at a gate the test opens."""
    r = Running(Server.build(QWEN, max_batch=1, max_seq_len=MAX_SEQ, max_queue=2))
    r.gate = threading.Event()
    r.gate.set()
    real = r.server.runner.launch_decode

    def launch_decode(*a):
        r.gate.wait(30)
        return real(*a)

    r.server.runner.launch_decode = launch_decode
    yield r
    r.gate.set()
    r.close()


def test_full_queue_is_a_429(small):
    small.gate.clear()
    results = {}

    def send(i):
        results[i] = post(small, {"model": QWEN, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    threads[0].start()
    deadline = time.time() + 10
    while not small.server.scheduler.running and time.time() < deadline:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    while len(small.server.scheduler.waiting) < 2 and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:  # the openai client's name for a 429
        small.client().completions.create(model=QWEN, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    assert small.metric("megadecode_waiting_requests") == 2
    small.gate.set()
    for t in threads:
        t.join(30)
    assert [results[i].status_code for i in range(3)] == [200, 200, 200]
    assert small.metric("megadecode_requests_total", 'outcome="rejected"') == 1


def test_a_client_that_leaves_mid_stream_frees_its_slot(small):
    aborted = small.metric("megadecode_requests_total", 'outcome="abort"')
    real = small.server.runner.launch_decode
    small.server.runner.launch_decode = lambda *a: (time.sleep(0.02), real(*a))[1]  # 60 tokens take > 1 s
    with httpx.stream("POST", small.url + "/v1/completions", timeout=30,
                      json={"model": QWEN, "prompt": "Hi", "max_tokens": 60, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read: leave
    small.wait_idle(5)  # long before the 60 tokens would have been generated
    assert small.metric("megadecode_requests_total", 'outcome="abort"') == aborted + 1
    r = complete(small, prompt="Hi", max_tokens=2)  # the slot serves the next request
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot(small):
    aborted = small.metric("megadecode_requests_total", 'outcome="abort"')
    small.gate.clear()  # the request sits in its slot
    with pytest.raises(httpx.TimeoutException):
        httpx.post(small.url + "/v1/completions", timeout=0.5,
                   json={"model": QWEN, "prompt": "Hi", "max_tokens": 60, "ignore_eos": True})
    deadline = time.time() + 10  # the handler sees the client gone (it looks every 0.5 s) and asks for the abort
    while not small.server.loop._aborts and time.time() < deadline:
        time.sleep(0.01)
    small.gate.set()
    small.wait_idle(10)
    assert small.metric("megadecode_requests_total", 'outcome="abort"') == aborted + 1


def test_a_failing_request_fails_alone(srv):
    """NaN logits for one request (a NaN in the embedding row of a token only its prompt has), amid others: it
    gets a 500 (an error event when streamed), the others their exact tokens, and the server goes on."""
    emb = srv.server.engine.executor.weights["model.embed_tokens.weight"]
    bad = 201
    saved = emb[bad, 0].item()
    emb[bad, 0] = float("nan")
    try:
        async def main():
            client = srv.async_client()
            good = [client.completions.create(model=QWEN, prompt=[BOS_ID, 5 + i, 9], max_tokens=6, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
                    for i in range(4)]
            broken = client.completions.create(model=QWEN, prompt=[BOS_ID, bad], max_tokens=6)
            return await asyncio.gather(*good, broken, return_exceptions=True)

        *good, broken = asyncio.run(main())
        assert isinstance(broken, openai.InternalServerError) and "NaN or inf" in str(broken)
        for i, r in enumerate(good):
            assert r.choices[0].token_ids == alone((BOS_ID, 5 + i, 9), 6, eos=False).token_ids[0]
        with httpx.stream("POST", srv.url + "/v1/completions", json={"model": QWEN, "prompt": [BOS_ID, bad],
                                                                     "max_tokens": 4, "stream": True}) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["error"]["code"] == "generation_failed"
    finally:
        emb[bad, 0] = saved
    assert srv.metric("megadecode_requests_total", 'outcome="error"') >= 2
    test_completion_is_the_greedy_generation(srv)


# ---- a bounded load test ------------------------------------------------------------------------------------------

def test_load_every_request_answered(srv):
    """300 requests, 32 at a time (the batch holds 8: the rest queue), streamed and not, of 1 to 8 tokens: every
    one is answered with all its tokens, none lost; a sample is checked token for token."""
    rng = random.Random(3)
    reqs = [([BOS_ID] + [rng.randrange(256) for _ in range(rng.randrange(1, 24))], rng.randrange(1, 9), rng.random() < .5)
            for _ in range(300)]
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


# ---- the command -----------------------------------------------------------------------------------------------------

def test_megadecode_serve_command():
    """The real command in a process of its own: it prints where it serves and the cold start, answers, and
    stops on SIGINT with exit code 0."""
    import re
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "megadecode", "serve", "--port", "0", "--max-batch", "2",
                          "--max-seq-len", "64"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"at http://127\.0\.0\.1:(\d+)/v1;", line)
            if m:
                break
        assert m, "".join(lines)
        assert re.search(r"cold start \(process start to first token\) \d+\.\d s", line), line
        url = f"http://127.0.0.1:{m.group(1)}"
        r = httpx.post(url + "/v1/completions", json={"model": QWEN, "prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err


@pytest.mark.parametrize("argv, text", [
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--batch-sizes", "4,16", "--max-batch", "8"], "--batch-sizes must be in [1, --max-batch = 8], got [4, 16]"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-seq-len", "100000"], "max_seq_len 100000 is outside [1, 512]"),
    (["--model", "no-such-model"], "'no-such-model' is neither a preset"),
])
def test_serve_flags_errors(capsys, argv, text):
    from megadecode.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("megadecode: error: ") and text in err and err.count("\n") == 1, err


def test_serve_on_a_taken_port(capsys, srv):
    from megadecode.cli import main

    assert main(["serve", "--port", str(srv.port)]) == 2
    assert f"cannot listen on 127.0.0.1:{srv.port}" in capsys.readouterr().err
