"""vLLM's /tokenize, /detokenize and /version on `megadecode serve`, and the API key (`--api-key`): every route but
/health answers 401 without `Authorization: Bearer <key>`, through the openai client and plain HTTP."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import httpx
import pytest

from megadecode import __version__
from megadecode.serve.chat import chat_prompt
from megadecode.serve.server import Server
from megadecode.tokenizer import BOS_ID
from serving import MAX_SEQ, QWEN, TOK, Running, post, srv  # noqa: F401 (srv: a fixture)

KEY = "sk-test-7f3a"


def test_tokenize_a_prompt_as_a_completion_does(srv):
    r = post(srv, {"model": QWEN, "prompt": "Héllo"}, "/tokenize")
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 7, "max_model_len": MAX_SEQ, "tokens": TOK.encode("Héllo")}
    assert r.json()["tokens"][0] == BOS_ID
    r = post(srv, {"prompt": "Héllo", "add_special_tokens": False}, "/tokenize")  # model optional
    assert r.json()["tokens"] == TOK.encode("Héllo", add_bos=False)


def test_tokenize_messages_through_the_chat_template(srv):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = post(srv, {"model": QWEN, "messages": msgs}, "/tokenize")
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat_prompt(TOK, msgs)
    assert r.json()["count"] == len(chat_prompt(TOK, msgs))


def test_detokenize_inverts_tokenize(srv):
    toks = post(srv, {"prompt": "a ü b"}, "/tokenize").json()["tokens"]
    r = post(srv, {"model": QWEN, "tokens": toks}, "/detokenize")
    assert r.status_code == 200 and r.json() == {"prompt": "a ü b"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(srv, path, body, status, param):
    r = post(srv, body, path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_version(srv):
    assert httpx.get(srv.url + "/version").json() == {"version": __version__}


@pytest.fixture(scope="module")
def keyed():
    r = Running(Server.build(QWEN, max_batch=2, max_seq_len=MAX_SEQ), api_key=KEY)
    yield r
    r.close()


def test_the_api_key_is_required_on_every_route_but_health(keyed):
    import openai

    ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == [QWEN]
    r = ok.completions.create(model=QWEN, prompt="Hi", max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError, match="not this server's"):
        keyed.client().models.list()  # the fixture's client sends api_key="unused"
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/version"), ("POST", "/tokenize"),
                         ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")):
        r = httpx.request(method, keyed.url + path, json={"prompt": "x"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "no API key given" in r.json()["error"]["message"]
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/version", headers=h).status_code == 200
    assert httpx.get(keyed.url + "/version", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert httpx.get(keyed.url + "/version", headers={"Authorization": KEY}).status_code == 401


def test_an_empty_key_is_refused_when_the_app_is_built():
    from megadecode.serve.api import build_app

    with pytest.raises(ValueError, match="empty"):
        build_app(object(), max_body_bytes=1, api_key="")
