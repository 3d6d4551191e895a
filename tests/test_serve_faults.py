"""`megadecode serve` under pressure: a full queue is a 429, a client that leaves frees its slot, a failing request
fails alone; and the command itself (its startup line, SIGINT, bad flags)."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from megadecode.serve.server import Server
from megadecode.tokenizer import BOS_ID
from serving import MAX_SEQ, QWEN, Running, alone, check_greedy, complete, post, srv  # noqa: F401 (srv: a fixture)


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
    deadline = time.time() + 10  # the handler sees the client gone and asks for the abort
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
    check_greedy(srv)


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
    (["--api-key", ""], "--api-key must be a non-empty key without surrounding spaces"),
    (["--api-key", " key"], "--api-key must be a non-empty key without surrounding spaces"),
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


def test_serve_on_a_checkpoint_with_nan_weights_says_so_in_one_line(capsys, tiny_ckpt):
    """The startup request's logits are NaN: one `megadecode: error:` line naming the checkpoint, as generate
    gives, not a traceback."""
    import math

    from test_cli import poison

    ckpt = tiny_ckpt("tiny-qwen3-moe")
    poison(ckpt, "model.layers.1.mlp.down_proj.weight", (3, 5), math.nan)
    from megadecode.cli import main

    assert main(["serve", "--model", str(ckpt), "--port", "0", "--max-batch", "2", "--max-seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megadecode: error: {ckpt}: the startup request failed: the logits for generated token 0")
    assert "NaN or inf (--check-finite names a tensor" in err and err.count("\n") == 1 and "Traceback" not in err
