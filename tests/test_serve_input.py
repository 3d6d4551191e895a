"""Bad input to `megadecode serve`: every malformed or out-of-range request is a 400 with an OpenAI-style error body
naming the field, a body too large a 413, an unknown route a 404, and a fuzz of random field values never gets a
500 or hurts the server (tests/serving.py: the server in a thread)."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import os
import random

import httpx
import pytest

from serving import MAX_SEQ, QWEN, alone, check_greedy, ids, post, srv  # noqa: F401 (srv: a fixture)


OK = {"model": QWEN, "prompt": "Hi", "max_tokens": 2}
BAD = [
    (b"{not json", None, "not valid JSON"),
    (b'{"model": "tiny-qwen3-moe", "prompt": "Hi", "temperature": NaN}', None, "NaN is not JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b"", None, "not valid JSON"),
    ({"prompt": "Hi"}, "model", "model is missing"),
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
    ({**OK, "n": 17}, "n", "in [1, 16]"),
    ({**OK, "n": 0}, "n", "in [1, 16]"),
    ({**OK, "echo": True}, "echo", "not supported"),
    ({**OK, "logprobs": 21}, "logprobs", "in [0, 20]"),
    ({**OK, "logprobs": True}, "logprobs", "must be an integer"),
    ({**OK, "stop": ""}, "stop", "non-empty string"),
    ({**OK, "stop": [1]}, "stop", "non-empty string"),
    ({**OK, "stop": ["a"] * 17}, "stop", "at most 16"),
    ({**OK, "stop_token_ids": [300]}, "stop_token_ids", "outside the vocabulary"),
    ({**OK, "stream": "yes"}, "stream", "true or false"),
    ({**OK, "stream_options": [1]}, "stream_options", "must be an object"),
    ({**OK, "top_k": -2}, "top_k", ">= -1"),
    ({**OK, "top_k": 2.5}, "top_k", "must be an integer"),
    ({**OK, "min_p": 1.5}, "min_p", "in [0, 1]"),
    ({**OK, "min_p": "x"}, "min_p", "must be a number"),
    # what the server does not do is refused, never ignored
    ({**OK, "repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
    ({**OK, "repetition_penalty": "x"}, "repetition_penalty", "must be a number"),
    ({**OK, "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({**OK, "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({**OK, "logit_bias": [5]}, "logit_bias", "must be an object"),
    ({**OK, "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({**OK, "logit_bias": {"100000": 1}}, "logit_bias", "not a token id in the vocabulary"),
    ({**OK, "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
    ({**OK, "logit_bias": {"5": True}}, "logit_bias", "in [-100, 100]"),
    ({**OK, "response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({**OK, "best_of": 3}, "best_of", "not supported"),
    ({**OK, "top_logprobs": 2}, "top_logprobs", "not supported"),
    ({**OK, "min_tokens": -1}, "min_tokens", "must be in [0, "),
    ({**OK, "max_tokens": 3, "min_tokens": 4}, "min_tokens", "in [0, 3]"),
    ({**OK, "echo": 0}, "echo", "not supported"),  # 0 is not false
    ({**OK, "guided_json": [1]}, "guided_json", "must be a JSON schema"),
    ({**OK, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unknown field"),
    ({**OK, "max_new_tokens": 5}, "max_new_tokens", "unknown field"),
    ({**OK, "messages": [{"role": "user", "content": "x"}]}, "messages", "unknown field"),  # a chat field
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
    ({"model": QWEN, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "in [0, 20]"),
    ({"model": QWEN, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs: true"),
]


@pytest.mark.parametrize("body, param, text", CHAT_BAD, ids=[str(i) for i in range(len(CHAT_BAD))])
def test_bad_chat_requests(srv, body, param, text):
    r = post(srv, body, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_neutral_values_of_fields_not_implemented_are_taken(srv):
    """What clients send by default (n 1, zero penalties, an empty logit_bias, text output, null fields) asks for
    nothing the server does not do: a 200 with the greedy tokens."""
    neutral = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
               "logit_bias": {}, "response_format": {"type": "text"}, "top_logprobs": 0, "tools": [],
               "tool_choice": "none", "user": "someone", "guided_json": None, "top_k": -1, "min_p": 0}
    r = post(srv, {"model": QWEN, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                   **neutral})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == alone(ids("Hello"), 12).token_ids[0]
    chat = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2,
            "prompt": None, **neutral}
    assert post(srv, chat, "/v1/chat/completions").status_code == 200


@pytest.mark.parametrize("field, value", [("best_of", 2), ("tools", [{"type": "function"}]),
                                          ("top_logprobs", 3)])
def test_the_openai_client_gets_a_400_naming_what_is_refused(srv, field, value):
    import openai

    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        if field == "tools":
            client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           **{field: value})
        else:
            client.completions.create(model=QWEN, prompt="Hi", max_tokens=2, extra_body={field: value})
    assert e.value.status_code == 400 and e.value.body["param"] == field and e.value.body["code"] == "unsupported"


def test_an_unknown_model_is_a_404_as_openai_and_vllm_answer(srv):
    import openai

    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(srv, {**OK, "messages": [{"role": "user", "content": "x"}], "model": "gpt-4"} if "chat" in path
                 else {**OK, "model": "gpt-4"}, path)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", r.text
        assert "'gpt-4' is not served here" in err["message"]
    with pytest.raises(openai.NotFoundError):
        srv.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=2)


def test_models_by_id(srv):
    m = srv.client().models.retrieve(QWEN)
    assert m.id == QWEN and m.object == "model" and m.owned_by == "megadecode"
    r = httpx.get(srv.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(srv.url + "/v1/models/org/name")  # a name with a slash reaches the route
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


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
            "logprobs", "stop_token_ids", "ignore_eos", "stream_options", "max_completion_tokens", "echo",
            "top_k", "min_p", "presence_penalty", "response_format", "unknown"]
    client = httpx.Client()
    for i in range(int(os.environ.get("MEGADECODE_FUZZ_N", 1000))):
        body = {"model": QWEN, "prompt": "Hi", "max_tokens": 2} if i % 3 else {}
        for k in rng.sample(keys, rng.randrange(1, 5)):
            body[k] = rng.choice(values)
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        r = post(srv, body, path, client)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)  # 404: an unknown model
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health").status_code == 200
    check_greedy(srv)
