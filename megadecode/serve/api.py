"""The HTTP layer (FastAPI on uvicorn): OpenAI's /v1/completions and /v1/chat/completions (server-sent events
when `stream`), /v1/models, /health and /metrics; vLLM's /tokenize, /detokenize and /version. With an API key
(`--api-key`) every route but /health answers 401 unless the request carries `Authorization: Bearer <key>`.

A handler checks the request (protocol.py: 400 with an OpenAI-style error body), queues it (429 when the queue
is full), then turns the deltas the engine loop sends into text (text.py) and a response. A client that leaves
(a closed stream, or a dropped connection while it waits for a whole response) aborts its sequence, which frees
its slot before the next step. Nothing a client sends reaches the engine unchecked, and any exception in a
handler becomes a 500 for that request alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..scheduler import QueueFull
from ..sequence import ERROR, STOP
from ..structured import GuideError
from .protocol import APIError, parse_detokenize, parse_json, parse_request, parse_tokenize
from .server import Server
from .text import TextStream

log = logging.getLogger("megadecode.serve")
LOGPROB_FLOOR = -9999.0  # what a logprob of -inf is sent as (OpenAI's floor)
GONE = object()  # put in a request's queue when its client disconnects


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _dump(doc: dict) -> str:
    return json.dumps(doc, allow_nan=False, separators=(",", ":"))


def build_app(server: Server, max_body_bytes: int | None = None, api_key: str | None = None) -> FastAPI:
    """`api_key`: what every request but GET /health must present as `Authorization: Bearer <key>` (None: none)."""
    app = FastAPI(title="megadecode", docs_url=None, redoc_url=None, openapi_url=None)
    limit = max_body_bytes or max(1 << 20, 64 * server.max_seq_len)

    if api_key is not None:
        if not api_key:
            raise ValueError("the API key is empty")
        want = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next):
            if request.url.path == "/health":
                return await call_next(request)
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):  # the same time whatever prefix matches
                why = "no API key given" if not got else "the API key is not this server's"
                return error_response(APIError(f"{why}: send Authorization: Bearer <key>", status=401,
                                               code="invalid_api_key"))
            return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": {"message": msg, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "megadecode",
                "max_model_len": server.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")  # :path: a served name may hold slashes (ORG/NAME)
    async def model(model: str):
        if model != server.model_name:
            return error_response(APIError(f"model {model!r} is not served here; this server serves "
                                           f"{server.model_name!r}", "model", status=404, code="model_not_found"))
        return card()

    @app.get("/version")
    async def version():
        from importlib.metadata import version as installed

        return {"version": installed("megadecode")}  # the installed distribution's (pyproject.toml)

    async def checked(request: Request, parse, answer):
        """A small POST route: the body parsed and checked by `parse` (an APIError is its 400 / 404 / 413), then
        `answer` of what it returned."""
        try:
            return answer(parse(parse_json(await _read_body(request, limit))))
        except APIError as e:
            return error_response(e)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await checked(
            request, lambda doc: parse_tokenize(doc, model=server.model_name, tokenizer=server.tokenizer),
            lambda tokens: {"count": len(tokens), "max_model_len": server.max_seq_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await checked(
            request, lambda doc: parse_detokenize(doc, model=server.model_name, vocab=server.vocab_size),
            lambda tokens: {"prompt": server.tokenizer.decode(tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(server, request, chat=False, limit=limit)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(server, request, chat=True, limit=limit)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(f"the request body has {size} bytes, more than this server's {limit}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(f"the request body exceeds this server's {limit} bytes", status=413)
    return bytes(body)


async def _generate(server: Server, request: Request, *, chat: bool, limit: int):
    arrived = time.perf_counter()
    try:
        doc = parse_json(await _read_body(request, limit))
        req = parse_request(doc, chat=chat, model=server.model_name, tokenizer=server.tokenizer,
                            vocab=server.vocab_size, max_seq_len=server.max_seq_len, eos_ids=server.eos_ids)
        if not server.loop.alive:
            raise APIError("the engine loop has stopped", status=503, type="server_error")
        compiled = None
        if req.guide is not None:  # compiled off the event loop (a large schema takes milliseconds)
            try:
                compiled = await asyncio.to_thread(server.compile_guide, req.guide)
            except GuideError as e:
                raise APIError(str(e), req.guide_key) from None
        try:
            seq, chan = server.submit(req, asyncio.get_running_loop(), compiled)  # seq: the request's n choices
        except QueueFull as e:
            server.metrics.refused("rejected")
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
    except APIError as e:
        if e.status != 429:
            server.metrics.refused("invalid")
        return error_response(e)
    except Exception as e:  # noqa: BLE001 - a bug in the checks: this request fails, the server stays up
        log.exception("request failed before it was queued")
        return error_response(APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error"))
    reply = Reply(server, req, seq, chan, chat, arrived)
    if req.stream:
        return EventStream(reply.events(), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await reply.whole(request)
    finally:
        reply.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: the ASGI server's `http.disconnect` (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """StreamingResponse that always closes its generator (running its `finally`) when the response ends, the
    client's disconnect included, instead of leaving that to garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Output:
    """One choice of a response, built from the engine loop's deltas of its sequence."""

    def __init__(self, server: Server, req, seq, index: int, arrived: float | None):
        """`arrived`: when the request came (the first token of choice 0 times the TTFT metric; None for others)."""
        self.server, self.req, self.seq, self.index, self.arrived = server, req, seq, index, arrived
        self.text = TextStream(server.tokenizer, req.stop)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple] = []  # per token kept: its top_logprobs alternatives, (id, logprob)
        self.finish_reason: str | None = None
        self.error: str | None = None

    def take(self, d) -> tuple[str, list[int], list[float], list[tuple]]:
        """Apply one delta: returns (new text, new tokens kept, their logprobs, their alternatives) and sets
        finish_reason when the sequence is done. A stop string ends it here (the tokens after the one that
        completed it are dropped, and the engine is told to abort the sequence)."""
        if d.token is not None and not self.tokens and self.arrived is not None:
            self.server.metrics.ttft.observe(time.perf_counter() - self.arrived)
        ids = [] if d.token is None else [d.token]
        text = self.text.add(ids) if ids else ""
        if d.finish_reason is not None and d.finish_reason != ERROR and not self.text.stopped:
            text += self.text.finish()
        kept = self.text.tokens_used - len(self.tokens)
        ids, lps, tops = ids[:kept], ([d.logprob] if ids else [])[:kept], ([d.top] if ids else [])[:kept]
        self.tokens += ids
        self.logprobs += lps
        self.tops += tops
        if self.text.stopped:
            self.finish_reason = "stop"
            self.server.close(self.seq, STOP)  # ended: a step the engine may still run for it is dropped
        elif d.finish_reason == ERROR:
            self.finish_reason, self.error = ERROR, d.error
        elif d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        return text, ids, lps, tops

    def choice(self, text, ids: list[int], lps: list[float], tops: list[tuple], finish_reason, chat: bool,
               chunk: bool) -> dict:
        """This choice's part of a response (the whole text) or of a chunk (`text` the delta: a string, or chat's
        delta object)."""
        doc = {"index": self.index, "finish_reason": finish_reason,
               "logprobs": self._logprobs(ids, lps, tops, chat) if self.req.logprobs and (ids or not chunk)
               else None}
        if chat:
            doc["delta" if chunk else "message"] = text if chunk else {"role": "assistant", "content": text}
        else:
            doc["text"] = text
        if self.req.return_token_ids:
            doc["token_ids"] = ids
        return doc

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[tuple], chat: bool) -> dict:
        """OpenAI's logprobs object of the tokens ids: chat's `content` list (each with its top_logprobs list),
        or completions' parallel lists (top_logprobs a {piece: logprob} dict per token, None when none asked)."""
        def piece(t: int) -> str:
            return self.server.tokenizer.decode([t])

        def finite(lp: float) -> float:
            return lp if math.isfinite(lp) else LOGPROB_FLOOR  # JSON has no -inf

        def by_piece(pairs) -> dict:  # tokens that decode alike keep the likelier one's logprob
            d = {}
            for a, alp in pairs:
                d.setdefault(piece(a), finite(alp))
            return d

        if chat:
            return {"content": [{"token": piece(t), "logprob": finite(lp), "bytes": list(piece(t).encode()),
                                 "top_logprobs": [{"token": piece(a), "logprob": finite(alp),
                                                   "bytes": list(piece(a).encode())} for a, alp in top]}
                                for t, lp, top in zip(ids, lps, tops)]}
        top = [by_piece(t) for t in tops] if self.req.top_logprobs else None
        return {"tokens": [piece(t) for t in ids], "token_logprobs": [finite(lp) for lp in lps],
                "top_logprobs": top, "text_offset": None}


class Reply:
    """A request's response: its n choices (Output each), whose deltas arrive on one channel as (choice, delta)."""

    def __init__(self, server: Server, req, seqs, chan, chat: bool, arrived: float):
        self.server, self.req, self.chan, self.chat = server, req, chan, chat
        self.outs = [Output(server, req, s, i, arrived if i == 0 else None) for i, s in enumerate(seqs)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @property
    def done(self) -> bool:
        return all(o.finish_reason is not None for o in self.outs)

    def failed(self) -> Output | None:
        return next((o for o in self.outs if o.finish_reason == ERROR), None)

    def close(self) -> None:
        for o in self.outs:
            self.server.close(o.seq)

    def failure(self, out: Output) -> APIError:
        return APIError(f"generation failed: {out.error}", status=500, type="server_error", code="generation_failed")

    def _gone(self, watcher: asyncio.Future) -> None:
        if not watcher.cancelled():
            watcher.exception()  # retrieved: a receive that failed means the client is gone too
            self.chan.queue.put_nowait(GONE)

    async def whole(self, request: Request):
        # A task waits for the client's disconnect while the tokens flow, and wakes this handler (GONE in its
        # queue) the moment it comes: the caller's `finally` aborts the sequences before the engine's next step.
        watcher = asyncio.ensure_future(_disconnected(request))
        watcher.add_done_callback(self._gone)
        text = [[] for _ in self.outs]
        try:
            while not self.done and self.failed() is None:
                item = await self.chan.queue.get()
                if item is GONE:
                    return Response(status_code=499)  # nobody reads it
                i, d = item
                if self.outs[i].finish_reason is None:  # a step queued after its stop string: dropped
                    text[i].append(self.outs[i].take(d)[0])
        finally:
            watcher.cancel()
        bad = self.failed()
        if bad is not None:
            return error_response(self.failure(bad))
        choices = [o.choice("".join(t), o.tokens, o.logprobs, o.tops, o.finish_reason, self.chat, False)
                   for o, t in zip(self.outs, text)]
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.server.model_name, "choices": choices,
                             "usage": self._usage()})

    async def events(self):
        """Server-sent events: a chunk per delta with text (each naming its choice), the last of each choice with
        its finish reason, the usage chunk when asked (stream_options.include_usage), then [DONE]. A failure is an
        `error` event."""
        try:
            if self.chat:
                for o in self.outs:
                    yield self._chunk(o.choice({"role": "assistant", "content": ""}, [], [], [], None, True, True))
            while not self.done:
                i, d = await self.chan.queue.get()
                o = self.outs[i]
                if o.finish_reason is not None:  # a step queued after its stop string: dropped
                    continue
                text, ids, lps, tops = o.take(d)
                if o.finish_reason == ERROR:
                    yield f"data: {_dump(self.failure(o).body())}\n\n"
                    break
                if text or o.finish_reason is not None or (ids and (self.req.logprobs or self.req.return_token_ids)):
                    yield self._chunk(o.choice({"content": text} if self.chat else text, ids, lps, tops,
                                               o.finish_reason, self.chat, True))
            if self.failed() is None and self.req.include_usage:
                yield f"data: {_dump(self._envelope([], usage=self._usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client left: the stream is closed here, and the slots freed
            self.close()

    def _envelope(self, choices: list, usage=None) -> dict:
        doc = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return doc

    def _chunk(self, choice: dict) -> str:
        return f"data: {_dump(self._envelope([choice]))}\n\n"

    def _usage(self) -> dict:
        """The prompt once (its prefill is shared by the choices), the tokens of every choice."""
        n, m = len(self.req.prompt), sum(len(o.tokens) for o in self.outs)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
