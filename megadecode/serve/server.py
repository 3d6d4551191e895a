"""The serving core without HTTP: the engine loop (its thread), the queues between it and the request handlers,
and startup (compiles and captures, then one request through the whole path, which times the cold start).

Each request gets a channel; the loop's `emit` hands a step's deltas to the channels in one call per asyncio
event loop (`call_soon_threadsafe`), so the loop thread never waits on a client.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections import defaultdict
from pathlib import Path

from ..engine import Engine, NonFiniteError
from ..runner import ModelRunner
from ..scheduler import Scheduler
from ..sequence import ABORT, Sequence
from .loop import NON_FINITE, Delta, EngineLoop
from .metrics import Metrics
from .protocol import Request


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where unknown."""
    try:
        import os

        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start
    except (OSError, ValueError, IndexError):
        return None


class Channel:
    """Where a request's deltas arrive: an asyncio queue of the handler's event loop, or (aio None) a thread
    queue. `choices`: a request's sequences by id -> its choice index; their deltas arrive as (choice, delta)
    (None: one sequence, its deltas as they are)."""

    def __init__(self, aio: asyncio.AbstractEventLoop | None, choices: dict[int, int] | None = None):
        self.aio = aio
        self.choices = choices
        self.queue: asyncio.Queue | queue.Queue = asyncio.Queue() if aio else queue.Queue()


class Server:
    """`engine`'s cache must hold max_batch + 1 slots (the runner's scratch slot: `Server.build` sees to it)."""

    def __init__(self, engine: Engine, tokenizer, *, model_name: str, max_queue: int = 256,
                 batch_sizes: list[int] | None = None, pad: bool | None = None, max_prefill_tokens: int | None = None,
                 mirror=None, drafter=None):
        """`mirror`: expert parallelism's rank 0 publishes every step to the other ranks (serve/lockstep.py).
        `drafter`: speculative decoding (speculative.NgramDrafter, DraftModelDrafter or MtpDrafter; one process; a
        KDA layer's state is rewound to the accepted prefix)."""
        if drafter is not None:
            from ..speculative import check_speculative

            check_speculative(engine)
            if mirror is not None:
                raise ValueError("speculative decoding runs in one process (no expert parallelism)")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.runner = ModelRunner(engine, batch_sizes, pad, mirror)
        self.max_batch = self.runner.max_batch
        self.scheduler = Scheduler(self.max_batch, max_queue, max_prefill_tokens)
        self.metrics = Metrics(self.max_batch)
        self.loop = EngineLoop(self.runner, self.scheduler, self._emit, self.metrics, drafter=drafter)
        self._channels: dict[int, Channel] = {}
        self.created = int(time.time())
        self.warmup_s = self.cold_start_s = None
        self.graphs = 0
        self.grammars = None  # structured.Grammars, made at the first guided request

    @classmethod
    def build(cls, model: str, *, max_batch: int, executor: str = "torch", device: str = "cpu",
              dtype: str = "float32", max_seq_len: int | None = None, seed: int = 0, check_finite: bool = False,
              ignore_unknown: bool = False, parallel=None, progress=None, mtp_draft_tokens: int = 0,
              **kw) -> "Server":
        """`mtp_draft_tokens` > 0: speculative decoding with the model's multi-token-prediction layer drafting that
        many tokens a sequence a step (speculative.MtpDrafter: the engine holds the MTP layer's weights)."""
        from ..presets import PRESETS
        from ..tokenizer import load_tokenizer

        if mtp_draft_tokens and kw.get("drafter") is not None:
            raise ValueError("one drafter: the MTP layer's (mtp_draft_tokens) or `drafter`, not both")
        engine = Engine.from_pretrained(model, device=device, dtype=dtype, executor=executor, seed=seed,
                                        check_finite=check_finite, ignore_unknown=ignore_unknown,
                                        max_batch=max_batch + 1, max_seq_len=max_seq_len, parallel=parallel,
                                        progress=progress, mtp=mtp_draft_tokens > 0)
        if mtp_draft_tokens:
            from ..speculative import MtpDrafter

            kw["drafter"] = MtpDrafter(engine, mtp_draft_tokens)
        tok = load_tokenizer(None if model in PRESETS else model)
        kw.setdefault("model_name", model)
        return cls(engine, tok, **kw)

    @property
    def vocab_size(self) -> int:
        return self.engine.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.cfg.eos_token_id)

    # ---- startup --------------------------------------------------------------------------------------------------
    def start(self, progress=None, warmup: bool = True) -> None:
        """Capture every decode graph serving can replay (`progress`: a tqdm bar), start the loop thread, and
        serve one request end to end (prefill, two decode steps: what the first real request would run first
        otherwise). Sets warmup_s and cold_start_s (process start to that request's first token)."""
        t = time.perf_counter()
        if warmup:
            self.graphs = self.runner.warmup(progress, drafter=self.loop.drafter)
        self.loop.start()
        if warmup:
            seq = Sequence(prompt=[0], max_tokens=3, stop_ids=frozenset())
            chan = self.submit_sequence(seq, aio=None)
            first = chan.queue.get(timeout=600)
            age = process_age()
            self.cold_start_s = age
            if age is not None:
                self.metrics.cold_start.set(age)
            while first.finish_reason is None:
                first = chan.queue.get(timeout=600)
            self.close(seq)
            if first.finish_reason == "error":
                if NON_FINITE in (first.error or ""):  # the weights' fault, not the server's: one line, no traceback
                    raise NonFiniteError(f"the startup request failed: {first.error}")
                raise RuntimeError(f"the startup request failed: {first.error}")
        self.warmup_s = time.perf_counter() - t

    def stop(self) -> None:
        self.loop.stop()
        mirror, self.runner.mirror = self.runner.mirror, None
        if mirror is not None:  # once: the other ranks stop replaying
            mirror.stop()

    # ---- requests -------------------------------------------------------------------------------------------------
    def compile_guide(self, spec):
        """A request's structured output guide compiled for this server's tokenizer (structured.Grammars, made at
        the first guided request); raises structured.GuideError."""
        from ..structured import Grammars

        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        return self.grammars.compile(spec)

    def submit(self, req: Request, aio: asyncio.AbstractEventLoop | None,
               compiled=None) -> tuple[list[Sequence], Channel]:
        """Queue a checked request's n choices (a sequence each, choice i seeded req.seed_of(i); `compiled`: its
        guide, compile_guide's, a matcher each), their deltas on one channel as (choice, delta); raises
        scheduler.QueueFull when the queue cannot take them all (then none stays queued)."""
        if (compiled is None) != (req.guide is None):
            raise ValueError("a guided request is submitted with its compiled guide (compile_guide), and only it")
        seqs = [Sequence(prompt=req.prompt, max_tokens=req.max_tokens, params=req.params, stop_ids=req.stop_ids,
                         seed=req.seed_of(i), min_tokens=req.min_tokens, top_logprobs=req.top_logprobs,
                         guide=None if compiled is None else self.grammars.guide(compiled))
                for i in range(req.n)]
        chan = Channel(aio, {s.id: i for i, s in enumerate(seqs)})
        queued = []
        try:
            for s in seqs:
                self._channels[s.id] = chan
                self.loop.submit(s)
                queued.append(s)
        except BaseException:
            for s in seqs:
                self._channels.pop(s.id, None)
            for s in queued:
                self.loop.abort(s.id, ABORT)
            raise
        self.metrics.admitted(len(req.prompt))  # once: the choices share the prompt's prefill
        return seqs, chan

    def submit_sequence(self, seq: Sequence, aio) -> Channel:
        chan = self._channels[seq.id] = Channel(aio)
        try:
            self.loop.submit(seq)
        except BaseException:
            self._channels.pop(seq.id, None)
            raise
        self.metrics.admitted(len(seq.prompt))
        return chan

    def close(self, seq: Sequence, reason: str = ABORT) -> None:
        """The handler is done with `seq` (finished, stopped by a stop string: STOP, or its client left: ABORT):
        end it for `reason` if it still runs, drop its channel."""
        self._channels.pop(seq.id, None)
        if not seq.finished:
            self.loop.abort(seq.id, reason)

    def _emit(self, items: list[tuple[Sequence, Delta]]) -> None:
        """Called by the loop thread once per step."""
        by_loop = defaultdict(list)
        for seq, delta in items:
            chan = self._channels.get(seq.id)
            if chan is None:
                continue  # the handler is gone
            item = delta if chan.choices is None else (chan.choices[seq.id], delta)
            if chan.aio is None:
                chan.queue.put(item)
            else:
                by_loop[chan.aio].append((chan.queue, item))
        for aio, batch in by_loop.items():
            try:
                aio.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop closed (shutdown)
                pass


def _deliver(batch) -> None:
    for q, delta in batch:
        q.put_nowait(delta)
