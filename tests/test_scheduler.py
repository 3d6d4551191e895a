"""The continuous-batching policy (megadecode/scheduler.py) and a request's state (megadecode/sequence.py), without
a model: the bounded queue, FIFO admission into the lowest free slots within the prefill budget, finish and
abort giving slots back."""

from __future__ import annotations

import itertools

import pytest

from megadecode.scheduler import QueueFull, Scheduler
from megadecode.sequence import ABORT, LENGTH, STOP, Sequence, Status


def seq(n: int = 3, max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(prompt=list(range(1, n + 1)), max_tokens=max_tokens, **kw)


def test_queue_is_bounded():
    s = Scheduler(num_slots=1, max_waiting=2)
    s.add(seq()), s.add(seq())
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        s.add(seq())
    s.schedule()  # one moves into the slot: room for one more
    s.add(seq())
    with pytest.raises(QueueFull):
        s.add(seq())


def test_admission_is_fifo_into_the_lowest_free_slots():
    s = Scheduler(num_slots=3, max_waiting=10)
    a, b, c, d = (seq() for _ in range(4))
    for x in (a, b, c, d):
        s.add(x)
    assert s.schedule() == [a, b, c]
    assert [x.slot for x in (a, b, c)] == [0, 1, 2] and d.status is Status.WAITING
    assert s.schedule() == []  # no free slot
    s.finish(b, LENGTH)
    assert b.status is Status.FINISHED and b.finish_reason == LENGTH
    assert s.schedule() == [d] and d.slot == 1
    assert s.running == [a, c, d]


def test_prefill_budget_admits_at_least_one():
    s = Scheduler(num_slots=4, max_waiting=10, max_prefill_tokens=10)
    long, short1, short2 = seq(20), seq(4), seq(4)
    for x in (long, short1, short2):
        s.add(x)
    assert s.schedule() == [long]  # over budget alone, still admitted
    assert s.schedule() == [short1, short2]


def test_abort_waiting_and_running():
    s = Scheduler(num_slots=1, max_waiting=10)
    a, b = seq(), seq()
    s.add(a), s.add(b)
    s.schedule()
    assert s.abort(b.id) is b and b.finish_reason == ABORT and not s.waiting
    assert s.abort(a.id) is a and s.free_slots == 1 and s.idle()
    assert s.abort(a.id) is None  # already gone
    s.finish(a, LENGTH)  # finishing twice changes nothing
    assert a.finish_reason == ABORT


def test_only_new_sequences_are_added():
    s = Scheduler(num_slots=1, max_waiting=10)
    a = seq()
    s.add(a)
    s.schedule()
    with pytest.raises(ValueError, match="only new sequences"):
        s.add(a)


def test_sequence_stops_at_stop_ids_and_length():
    a = seq(max_tokens=3, stop_ids=frozenset({7}))
    assert a.append(5, -0.1) is None and a.last_token == 5 and a.num_tokens == 4
    assert a.append(7, -0.2) == STOP
    b = seq(max_tokens=2)
    assert b.append(7, 0.0) is None and b.append(8, 0.0) == LENGTH
    with pytest.raises(ValueError, match="max_tokens"):
        seq(max_tokens=0)
    with pytest.raises(ValueError, match="prompt"):
        Sequence(prompt=[], max_tokens=1)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_slots_never_shared_whatever_the_finish_order(order):
    """Four sequences through two slots, finishing in every order: a running sequence's slot is its own, and
    every sequence is admitted exactly once."""
    s = Scheduler(num_slots=2, max_waiting=10)
    seqs = [seq() for _ in range(4)]
    for x in seqs:
        s.add(x)
    admitted = []
    for i in order:
        admitted += s.schedule()
        slots = [x.slot for x in s.running]
        assert len(set(slots)) == len(slots) and set(slots) <= {0, 1}
        if seqs[i].status is Status.WAITING:
            s.abort(seqs[i].id)
        else:
            s.finish(seqs[i], LENGTH)
    admitted += s.schedule()
    assert s.idle() and s.free_slots == 2
    assert len(admitted) == len(set(map(id, admitted)))
