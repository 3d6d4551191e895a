"""Continuous batching policy: a bounded FIFO queue of waiting sequences, the cache slots, and which sequences
run in the next step. It never touches tensors (the model runner does), and is not thread-safe: one owner
(serve/loop.py holds a lock around it).

Between two decode steps waiting sequences are admitted into free slots, oldest first, as long as their prompts
fit the prefill budget (at least one is admitted when a slot is free, whatever its length); a finished or
aborted sequence gives its slot back at once. Running sequences are never preempted: a slot is held from
admission to finish, so a newcomer's prefill never costs the others their progress."""

from __future__ import annotations

import heapq
from collections import deque

from .sequence import ABORT, Sequence, Status


class QueueFull(Exception):
    """The waiting queue holds its maximum: the server answers 429."""


class Scheduler:
    def __init__(self, num_slots: int, max_waiting: int, max_prefill_tokens: int | None = None):
        if num_slots < 1 or max_waiting < 0:
            raise ValueError(f"need >= 1 slot and >= 0 waiting places, got {num_slots} and {max_waiting}")
        self.num_slots, self.max_waiting, self.max_prefill_tokens = num_slots, max_waiting, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free = list(range(num_slots))  # a heap: the lowest free slot first (deterministic placement)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        if seq.status is not Status.WAITING or seq.slot is not None:
            raise ValueError(f"sequence {seq.id} is {seq.status.value}; only new sequences can be added")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting, the most this server queues "
                            f"({self.num_slots} run at once); retry later")
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences into free slots; returns them (to prefill). The next decode step runs
        `running` (the admitted ones included, once prefilled)."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and self._free:
            n = len(self.waiting[0].prompt)
            if admitted and budget is not None and n > budget:
                break
            seq = self.waiting.popleft()
            seq.slot, seq.status = heapq.heappop(self._free), Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            if budget is not None:
                budget -= n
        return admitted

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End `seq` (running or waiting) for `reason`; its slot is free for the next admission."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            heapq.heappush(self._free, seq.slot)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error

    def abort(self, seq_id: int, reason: str = ABORT) -> Sequence | None:
        """Finish the sequence with this id (ABORT, or STOP for a stop string the text layer found) wherever it is;
        None if it is not here (already done)."""
        for seq in (*self.waiting, *self.running):
            if seq.id == seq_id:
                self.finish(seq, reason)
                return seq
        return None
