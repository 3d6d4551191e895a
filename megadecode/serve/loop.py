"""The engine loop: one thread owns the model runner and the scheduler and runs steps while there is work
(vLLM's engine core, nano-vllm's LLMEngine.step in a loop). HTTP handlers talk to it only through `submit`,
`abort` and the `emit` callback, which it calls once per step with every new token of that step.

An iteration: apply the aborts, admit newcomers into free slots and prefill them (their first token), then one
decode step of every running sequence (queued before the previous one's tokens are read: `iteration`). A failure
stays with its request: a prefill that raises is retried per sequence so only the culprit fails; a row whose
logits are NaN or inf fails that sequence alone (its slot is zeroed before reuse); a decode step that raises fails
the sequences of that step, and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runner import ModelRunner
from ..scheduler import Scheduler
from ..sequence import ABORT, ERROR, Sequence

log = logging.getLogger("megadecode.serve")
NON_FINITE = "hold NaN or inf"  # in the error of a sequence whose logits did (serve/main.py: a broken checkpoint)


@dataclass(frozen=True)
class Delta:
    """What one step did to one sequence: a new token (None when it finished without one), and, when it is
    done, why (sequence.STOP, LENGTH, ERROR) with the error message for ERROR."""

    token: int | None
    logprob: float | None
    finish_reason: str | None = None
    error: str | None = None
    top: tuple = ()  # the sequence's top_logprobs most likely tokens at this step: (id, logprob), most likely first


class NullMetrics:
    """What the loop reports (serve/metrics.py implements it for Prometheus)."""

    def step(self, kind: str, seconds: float, batch: int, padded: int) -> None: ...
    def state(self, waiting: int, running: int) -> None: ...
    def finished(self, seq: Sequence) -> None: ...
    def speculated(self, drafted: int, accepted: int) -> None: ...


class EngineLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 emit: Callable[[list[tuple[Sequence, Delta]]], None], metrics=None, overlap: bool = True,
                 drafter=None):
        """`drafter` (speculative.NgramDrafter, DraftModelDrafter or MtpDrafter): decode steps verify its drafts
        (ModelRunner.verify) instead of one token a sequence, eagerly and without a step launched ahead; a drafter
        that reads hidden states is given the prefills' too."""
        self.runner, self.scheduler, self.emit, self.overlap = runner, scheduler, emit, overlap
        self.drafter = drafter
        self._pending = None  # a launched decode step (runner.Launched) not collected yet
        self._last_collect = 0.0
        self.metrics = metrics or NullMetrics()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: list[tuple[int, str]] = []  # (sequence id, finish reason)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_error: str | None = None

    # ---- called from other threads ----------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue `seq`; raises scheduler.QueueFull when the queue is full."""
        with self._lock:
            self.scheduler.add(seq)
            self.metrics.state(len(self.scheduler.waiting), len(self.scheduler.running))
        self._wake.set()

    def abort(self, seq_id: int, reason: str = ABORT) -> None:
        """Stop the sequence (a client gone: ABORT, or a stop string found: STOP); its slot frees before the next
        step."""
        with self._lock:
            self._aborts.append((seq_id, reason))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="megadecode-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ---- the loop thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.runner.device.type == "cuda":  # a thread's current GPU is its own: this one's is the engine's
            torch.cuda.set_device(self.runner.device)
        try:
            with torch.inference_mode():
                while not self._stop:
                    try:
                        if not self.iteration():
                            self._wake.wait(0.5)
                            self._wake.clear()
                    except Exception:  # a bug of the loop itself: fail what is in flight, keep serving
                        self.last_error = traceback.format_exc()
                        log.error("engine loop error:\n%s", self.last_error)
                        self._pending = None
                        self._fail(list(self.scheduler.running), "internal error in the engine loop")
        finally:  # stopped (or killed by a BaseException): no request waits for a loop that is gone
            self._stop = True
            with self._lock:
                left = [*self.scheduler.waiting, *self.scheduler.running]
            self._fail(left, "the server is shutting down")

    def iteration(self) -> bool:
        """One scheduling round: aborts, admissions with their prefill, one decode step. False when idle.

        With `overlap`, while the running sequences stay the same the next decode step is launched, fed on the
        device with the tokens of the step in flight, before that step's results are collected: the GPU has the
        next step queued while the host handles the last one's tokens. A sequence that finished in the collected
        step has a row in the step launched meanwhile: its result is dropped (its cache slot is written at one
        position more, which its next owner's prefill overwrites or masks). A change of the running set (an
        admission, an abort, a finish) collects the step in flight first and launches from the host's tokens."""
        with self._lock:
            aborts, self._aborts = self._aborts, []
            for seq_id, reason in aborts:
                seq = self.scheduler.abort(seq_id, reason)
                if seq is not None:
                    self.metrics.finished(seq)
            admitted = self.scheduler.schedule()
            self.metrics.state(len(self.scheduler.waiting), len(self.scheduler.running))
        out: list[tuple[Sequence, Delta]] = []
        if not self.scheduler.running and self._pending is None:
            return False
        if admitted:
            self._flush(out)
            self._prefill(admitted, out)
        decoding = list(self.scheduler.running)  # the admitted ones too, unless done at their first token
        # a guided sequence's next mask needs this step's token on the host: no step launched ahead of it
        after = self._pending if self._pending is not None and self._pending.seqs == decoding \
            and not any(s.guide is not None for s in decoding) else None
        if after is None:
            self._flush(out)
        if decoding and self.drafter is not None:
            self._flush(out)
            self._verify(decoding, out)
        elif decoding:
            launched = self._launch(decoding, after, out)
            if after is not None:
                self._collect(after, out)
            self._pending = launched
            if not self.overlap:
                self._flush(out)
        self.steps += 1
        if out:
            self.emit(out)
        return True

    def _launch(self, seqs: list[Sequence], after, out: list):
        try:
            step = self.runner.launch_decode(seqs, after)
        except Exception as e:  # noqa: BLE001 - the step's sequences fail, the server goes on
            self.last_error = traceback.format_exc()
            log.error("decode step failed:\n%s", self.last_error)
            if after is not None:
                self._collect(after, out)
            self._fail(seqs, f"the decode step failed: {type(e).__name__}: {e}", out)
            return None
        step.launched = time.perf_counter()
        return step

    def _verify(self, seqs: list[Sequence], out: list) -> None:
        t = time.perf_counter()
        try:
            results, drafted, accepted = self.runner.verify(seqs, self.drafter)
        except Exception as e:  # noqa: BLE001 - the step's sequences fail, the server goes on
            self.last_error = traceback.format_exc()
            log.error("verify step failed:\n%s", self.last_error)
            self._fail(seqs, f"the decode step failed: {type(e).__name__}: {e}", out)
            return
        self.metrics.step("decode", time.perf_counter() - t, len(seqs), len(seqs))
        self.metrics.speculated(drafted, accepted)
        for j in range(max(map(len, results))):  # a sequence's tokens in order; _record skips the finished
            got = [(s, r[j]) for s, r in zip(seqs, results) if j < len(r)]
            self._record([s for s, _ in got], [r for _, r in got], out)

    def _flush(self, out: list) -> None:
        """Collect the decode step in flight, if any."""
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._collect(step, out)

    def _collect(self, step, out: list) -> None:
        if step is self._pending:
            self._pending = None
        try:
            results = self.runner.collect(step)
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA error surfacing at the wait
            self.last_error = traceback.format_exc()
            log.error("decode step failed:\n%s", self.last_error)
            self._fail(step.seqs, f"the decode step failed: {type(e).__name__}: {e}", out)
            return
        now = time.perf_counter()
        live = [s for s in step.seqs if not s.finished]
        # the step's own time: from its launch, or from the previous result when it was queued behind a step
        self.metrics.step("decode", now - max(step.launched, self._last_collect), len(live),
                          self.runner.padded(len(step.seqs)))
        self._last_collect = now
        self._record(step.seqs, results, out)

    def _prefill(self, admitted: list[Sequence], out: list) -> None:
        t = time.perf_counter()
        try:
            results = self.runner.prefill(admitted, self.drafter)
        except Exception:  # noqa: BLE001 - find the culprit: each newcomer alone
            if len(admitted) == 1:
                e = traceback.format_exc()
                log.error("prefill failed:\n%s", e)
                self._fail(admitted, "the prefill failed: " + e.strip().splitlines()[-1], out)
                return
            for seq in admitted:
                self._prefill([seq], out)
            return
        self.metrics.step("prefill", time.perf_counter() - t, len(admitted), len(admitted))
        self._record(admitted, results, out)

    def _record(self, seqs: list[Sequence], results, out: list) -> None:
        done = []
        for seq, (token, logprob, finite, top) in zip(seqs, results):
            if seq.finished:
                continue
            if not finite:
                done.append((seq, ERROR, f"the logits for generated token {len(seq.output)} (position "
                                         f"{seq.num_tokens - 1}) {NON_FINITE}"))
                continue
            reason = seq.append(token, logprob)
            if reason == ERROR:  # a token its guide refused
                done.append((seq, ERROR, seq.error))
                continue
            out.append((seq, Delta(token, logprob, reason, top=top)))
            if reason is not None:
                done.append((seq, reason, None))
        if done:
            with self._lock:
                for seq, reason, error in done:
                    if reason == ERROR:
                        self.runner.clear(seq.slot)
                        out.append((seq, Delta(None, None, ERROR, error)))
                    self.scheduler.finish(seq, reason, error)
                    self.metrics.finished(seq)

    def _fail(self, seqs: list[Sequence], message: str, out: list | None = None) -> None:
        flush = out is None
        out = [] if out is None else out
        with self._lock:
            for seq in seqs:
                if seq.finished:
                    continue
                if seq.slot is not None:
                    self.runner.clear(seq.slot)
                self.scheduler.finish(seq, ERROR, message)
                self.metrics.finished(seq)
                out.append((seq, Delta(None, None, ERROR, message)))
        if flush and out:
            self.emit(out)
