"""A `megadecode serve` server in a thread of the test process, on a free localhost port: the serve tests talk to
it over real HTTP with the openai client and httpx."""

from __future__ import annotations

import threading
import time

import uvicorn

from megadecode.serve.api import build_app
from megadecode.serve.main import bind
from megadecode.serve.server import Server


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
