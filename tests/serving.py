"""A `megadecode serve` server in a thread of the test process, on a free localhost port: the serve tests talk to
it over real HTTP with the openai client and httpx."""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import pytest
import uvicorn

from megadecode.engine import Engine
from megadecode.sampling import SamplingParams
from megadecode.serve.api import build_app
from megadecode.serve.main import bind
from megadecode.serve.server import Server
from megadecode.tokenizer import ByteTokenizer

QWEN = "tiny-qwen3-moe"
MAX_SEQ = 64
TOK = ByteTokenizer()


class Running:
    def __init__(self, server: Server, **app_kw):
        self.server = server
        server.start()
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = uvicorn.Server(uvicorn.Config(build_app(server, **app_kw), log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.http.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        """A sample of GET /metrics, e.g. metric("megadecode_requests_total", 'outcome="abort"')."""
        import httpx

        key = f"{name}{{{labels}}}" if labels else name
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        raise KeyError(key)

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.time() + timeout
        while not self.server.scheduler.idle() or self.server.loop._aborts:
            if time.time() > deadline:
                raise AssertionError("the server did not become idle")
            time.sleep(0.01)

    def close(self) -> None:
        self.http.should_exit = True
        self.thread.join(10)
        self.server.stop()


@functools.lru_cache(maxsize=None)
def oracle() -> Engine:
    return Engine.from_pretrained(QWEN, max_batch=1, max_seq_len=MAX_SEQ)


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple, n: int, eos: bool = True, params=SamplingParams(greedy=True), seed: int = 0):
    """Engine.generate of one prompt alone: the oracle of what the server returns."""
    return oracle().generate([list(prompt)], n, params, seed=seed, stop_at_eos=eos)


@pytest.fixture(scope="module")
def srv():
    """tiny-qwen3-moe, torch executor, 8 slots, context 64, a queue that never fills."""
    r = Running(Server.build(QWEN, max_batch=8, max_seq_len=MAX_SEQ, max_queue=1000))
    yield r
    r.close()


def ids(text: str) -> tuple:
    return tuple(TOK.encode(text))


def complete(srv, **kw):
    kw.setdefault("model", QWEN)
    return srv.client().completions.create(**kw)


def post(srv, body, path="/v1/completions", client=httpx):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(srv.url + path, content=data, headers={"content-type": "application/json"}, timeout=30)


def check_greedy(srv) -> None:
    """The server still answers a request with exactly its greedy tokens."""
    r = complete(srv, prompt="Hello", max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == alone(ids("Hello"), 12).token_ids[0]
