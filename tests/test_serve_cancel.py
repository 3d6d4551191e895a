"""A client that leaves has its request aborted within one engine step, streaming or not, while the engine is
producing its tokens: its slot is free for the next request at once (--max-batch 1), and under load the others
get exactly their tokens."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import asyncio
import threading
import time

import httpx
import pytest

from megadecode.serve.server import Server
from serving import MAX_SEQ, QWEN, Running, alone, ids

STEP_S = 0.05  # each decode step is held this long: 60 tokens take 3 s, a leave is seen long before


def slow_steps(r: Running) -> None:
    real = r.server.runner.launch_decode
    r.server.runner.launch_decode = lambda *a: (time.sleep(STEP_S), real(*a))[1]


def watch(r: Running) -> list:
    """Every sequence the server is given, in order (to read how many tokens it got)."""
    seen, real = [], r.server.loop.submit

    def submit(seq):
        seen.append(seq)
        real(seq)

    r.server.loop.submit = submit
    return seen


@pytest.fixture
def one():
    """One slot, steps slowed to STEP_S."""
    r = Running(Server.build(QWEN, max_batch=1, max_seq_len=MAX_SEQ, max_queue=8))
    slow_steps(r)
    yield r
    r.close()


def wait_tokens(seq, n: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while len(seq.output) < n:
        assert time.time() < deadline, f"the sequence has {len(seq.output)} tokens, not {n}"
        time.sleep(0.005)


LONG = {"model": QWEN, "prompt": "Hi", "max_tokens": 60, "ignore_eos": True}


def test_a_whole_response_client_that_leaves_is_aborted_within_a_step(one):
    """The non-streaming path while tokens flow: before, it looked for the client only after 0.5 s without a
    token, so the request ran to its max_tokens."""
    aborted = one.metric("megadecode_requests_total", 'outcome="abort"')
    seen = watch(one)
    gone = threading.Event()

    def send():
        try:
            httpx.post(one.url + "/v1/completions", json=LONG, timeout=0.6)  # gives up after ~12 tokens
        except httpx.TimeoutException:
            gone.set()

    t = threading.Thread(target=send)
    t.start()
    assert gone.wait(10)
    seq = seen[0]
    at_leave = len(seq.output)
    one.wait_idle(5)
    t.join(5)
    assert seq.finish_reason == "abort"
    assert 5 <= at_leave < 60 and len(seq.output) <= at_leave + 2, (at_leave, len(seq.output))  # the step in flight
    assert one.metric("megadecode_requests_total", 'outcome="abort"') == aborted + 1
    assert one.server.scheduler.free_slots == 1


def test_a_stream_client_that_leaves_is_aborted_within_a_step(one):
    seen = watch(one)
    with httpx.stream("POST", one.url + "/v1/completions", timeout=30, json={**LONG, "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 5:
                break
        at_leave = len(seen[0].output)
    one.wait_idle(5)
    assert seen[0].finish_reason == "abort" and len(seen[0].output) <= at_leave + 2, (at_leave, len(seen[0].output))


def test_the_openai_client_closing_a_stream_aborts_it(one):
    seen = watch(one)
    stream = one.client().completions.create(model=QWEN, prompt="Hi", max_tokens=60, stream=True,
                                             extra_body={"ignore_eos": True})
    for _ in range(5):
        next(stream)
    at_leave = len(seen[0].output)
    stream.close()
    one.wait_idle(5)
    assert seen[0].finish_reason == "abort" and len(seen[0].output) <= at_leave + 2, (at_leave, len(seen[0].output))


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_request_is_not_held_up(one, stream):
    """--max-batch 1: a request queued behind one whose client leaves starts within a step or two of the leave."""
    seen = watch(one)
    box = {}

    def leave():
        try:
            if stream:
                with httpx.stream("POST", one.url + "/v1/completions", timeout=30,
                                  json={**LONG, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and len(seen[0].output) >= 6:
                            break
            else:
                httpx.post(one.url + "/v1/completions", json=LONG, timeout=0.5)
        except httpx.TimeoutException:
            pass
        box["left"] = time.perf_counter()

    t = threading.Thread(target=leave)
    t.start()
    while not seen or len(seen[0].output) < 2:
        time.sleep(0.005)
    r = httpx.post(one.url + "/v1/completions", timeout=30,
                   json={"model": QWEN, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    done = time.perf_counter()
    t.join(5)
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == alone(ids("Hello"), 3, eos=False).token_ids[0]
    assert seen[0].finish_reason == "abort" and len(seen[0].output) < 30
    assert done - box["left"] < 3 * STEP_S + 2.0, done - box["left"]  # its own 3 tokens, a prefill, slack


def test_leaves_under_load():
    """Eight requests at once on four slots, half of them abandoned (whole and streamed) while tokens flow: those
    are aborted, the others get exactly the tokens each gets alone, and every slot is free at the end."""
    r = Running(Server.build(QWEN, max_batch=4, max_seq_len=MAX_SEQ, max_queue=16))
    slow_steps(r)
    try:
        async def keep(client, i):
            res = await client.post("/v1/completions", json={
                "model": QWEN, "prompt": [256, 10 + i], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            return res.json()["choices"][0]["token_ids"]

        async def abandon(client, i):
            body = {**LONG, "prompt": [256, 40 + i]}
            if i % 2:
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as res:
                    async for line in res.aiter_lines():
                        if line.startswith("data: {"):
                            return "left"
            try:
                await client.post("/v1/completions", json=body, timeout=0.5)
            except httpx.TimeoutException:
                return "left"

        async def main():
            async with httpx.AsyncClient(base_url=r.url, timeout=30) as client:
                jobs = [keep(client, i) if i % 2 == 0 else abandon(client, i // 2) for i in range(8)]
                return await asyncio.gather(*jobs)

        seen = watch(r)
        t0 = time.perf_counter()
        out = asyncio.run(main())
        r.wait_idle(5)
        elapsed = time.perf_counter() - t0
        for i in range(0, 8, 2):
            assert out[i] == alone((256, 10 + i), 8, eos=False).token_ids[0]
        assert out[1::2] == ["left"] * 4
        left = [s for s in seen if s.max_tokens == 60]
        assert [s.finish_reason for s in left] == ["abort"] * 4
        assert all(len(s.output) < 30 for s in left), [len(s.output) for s in left]
        assert elapsed < 60 * STEP_S, elapsed  # nobody waited for an abandoned request to run to its length
        assert r.server.scheduler.free_slots == 4 and not r.server.scheduler.running
    finally:
        r.close()
