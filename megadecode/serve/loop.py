"""The engine loop: one thread owns the model runner and the scheduler and runs steps while there is work
(vLLM's engine core, nano-vllm's LLMEngine.step in a loop). HTTP handlers talk to it only through `submit`,
`abort` and the `emit` callback, which it calls once per step with every new token of that step.

An iteration: apply the aborts, admit newcomers into free slots and prefill them (their first token), then one
decode step of every running sequence. A failure stays with its request: a prefill that raises is retried per
sequence so only the culprit fails; a row whose logits are NaN or inf fails that sequence alone (its slot is
zeroed before reuse); a decode step that raises fails the sequences of that step, and the loop goes on.
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
from ..sequence import ERROR, Sequence

log = logging.getLogger("megadecode.serve")


@dataclass(frozen=True)
class Delta:
    """What one step did to one sequence: a new token (None when it finished without one), and, when it is
    done, why (sequence.STOP, LENGTH, ERROR) with the error message for ERROR."""

    token: int | None
    logprob: float | None
    finish_reason: str | None = None
    error: str | None = None


class NullMetrics:
    """What the loop reports (serve/metrics.py implements it for Prometheus)."""

    def step(self, kind: str, seconds: float, batch: int, padded: int) -> None: ...
    def state(self, waiting: int, running: int) -> None: ...
    def finished(self, seq: Sequence) -> None: ...


class EngineLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 emit: Callable[[list[tuple[Sequence, Delta]]], None], metrics=None):
        self.runner, self.scheduler, self.emit = runner, scheduler, emit
        self.metrics = metrics or NullMetrics()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: list[int] = []
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

    def abort(self, seq_id: int) -> None:
        """Stop the sequence (a client gone, or a stop string found); its slot frees before the next step."""
        with self._lock:
            self._aborts.append(seq_id)
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
        with torch.inference_mode():
            while not self._stop:
                try:
                    if not self.iteration():
                        self._wake.wait(0.5)
                        self._wake.clear()
                except Exception:  # a bug of the loop itself: fail what is in flight, keep serving
                    self.last_error = traceback.format_exc()
                    log.error("engine loop error:\n%s", self.last_error)
                    self._fail(list(self.scheduler.running), "internal error in the engine loop")

    def iteration(self) -> bool:
        """One scheduling round: aborts, admissions with their prefill, one decode step. False when idle."""
        with self._lock:
            aborts, self._aborts = self._aborts, []
            for seq_id in aborts:
                seq = self.scheduler.abort(seq_id)
                if seq is not None:
                    self.metrics.finished(seq)
            admitted = self.scheduler.schedule()
            running = list(self.scheduler.running)
            self.metrics.state(len(self.scheduler.waiting), len(running))
        if not running:
            return False
        out: list[tuple[Sequence, Delta]] = []
        if admitted:
            self._prefill(admitted, out)
        decoding = list(self.scheduler.running)  # the admitted ones too, unless done at their first token
        if decoding:
            t = time.perf_counter()
            try:
                results = self.runner.decode(decoding)
            except Exception as e:  # noqa: BLE001 - the step's sequences fail, the server goes on
                self.last_error = traceback.format_exc()
                log.error("decode step failed:\n%s", self.last_error)
                self._fail(decoding, f"the decode step failed: {type(e).__name__}: {e}", out)
            else:
                self.metrics.step("decode", time.perf_counter() - t, len(decoding), self.runner.padded(len(decoding)))
                self._record(decoding, results, out)
        self.steps += 1
        if out:
            self.emit(out)
        return True

    def _prefill(self, admitted: list[Sequence], out: list) -> None:
        t = time.perf_counter()
        try:
            results = self.runner.prefill(admitted)
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
        for seq, (token, logprob, finite) in zip(seqs, results):
            if seq.finished:
                continue
            if not finite:
                done.append((seq, ERROR, f"the logits for generated token {len(seq.output)} (position "
                                         f"{seq.num_tokens - 1}) hold NaN or inf"))
                continue
            reason = seq.append(token, logprob)
            out.append((seq, Delta(token, logprob, reason)))
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
