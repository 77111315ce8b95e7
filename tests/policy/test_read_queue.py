"""ReadQueue rules (qnpipe/policy/read_queue.py): merging, the in-flight budget, DEMAND first, FIFO per class,
one class per batch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe.policy.read_queue import Job, ReadClass, ReadQueue
from tests.profiles import examples

KEYS = st.tuples(st.integers(0, 1), st.integers(0, 3))  # (layer, expert): few, so duplicates are common
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), KEYS, st.sampled_from(ReadClass)),
        st.tuples(st.just("push"), KEYS, st.sampled_from(ReadClass)),  # pushes 3x as likely
        st.tuples(st.just("push"), KEYS, st.sampled_from(ReadClass)),
        st.tuples(st.just("take"), st.none(), st.none()),
        st.tuples(st.just("done"), st.integers(0, 1000), st.none()),
    ),
    max_size=80,
)


def job(key: tuple[int, int], cls: ReadClass) -> Job:
    layer, expert = key
    return Job(layer, expert, slot=expert, cls=cls)  # one slot per expert, as the pool would give


# more: a pure queue, cheap, with many operation orders
@examples(200)
@given(budget=st.integers(1, 3), batch=st.booleans(), ops=OPS)
def test_read_queue_rules(budget: int, batch: bool, ops: list[tuple[str, object, object]]) -> None:
    q = ReadQueue(budget, batch=batch)
    dq: list[tuple[int, int]] = []  # model: demand keys queued, in the order a step started waiting
    pq: list[tuple[int, int]] = []  # model: prefetch keys queued, in push order
    in_flight: set[tuple[int, int]] = set()
    accepted = taken = merged = 0
    for op, a, b in ops:
        if op == "push":
            key, cls = a, b
            assert isinstance(key, tuple) and isinstance(cls, ReadClass)
            fresh = q.push(job(key, cls))
            # duplicate requests read once: a key queued or in flight merges
            assert fresh == (key not in dq and key not in pq and key not in in_flight)
            if fresh:
                accepted += 1
                (dq if cls is ReadClass.DEMAND else pq).append(key)
            else:
                merged += 1
                if cls is ReadClass.DEMAND and key in pq:  # a step now waits on a queued prefetch
                    pq.remove(key)
                    dq.append(key)
        elif op == "take":
            out = q.take()
            keys = [j.key for j in out]
            for k in keys:
                assert k not in in_flight, "take() returned a job that is already in flight"
            # the budget is never exceeded, and take() fills it (one job without batch) when work is queued
            room = budget - len(in_flight)
            assert len(in_flight) + len(out) <= budget
            # one class per batch: demands when any are queued, else prefetches
            assert len(out) == min(room if batch else min(room, 1), len(dq) or len(pq))
            assert not (any(k in pq for k in keys) and any(k in dq for k in keys)), "a batch mixed classes"
            # demand before prefetch: no prefetch goes while a demanded read is still queued
            if any(k in pq for k in keys):
                assert not dq, "a prefetch was taken while a demanded read waited"
            # the exact order: demands first come first served, then prefetches
            assert keys == (dq or pq)[: len(keys)]
            for k in keys:
                (dq if k in dq else pq).remove(k)
                in_flight.add(k)
            taken += len(out)
            assert q.peak_in_flight <= budget
        elif in_flight:
            assert isinstance(a, int)
            k = sorted(in_flight)[a % len(in_flight)]
            q.done(Job(k[0], k[1], slot=k[1]))
            in_flight.discard(k)
        assert len(q) == len(dq) + len(pq) + len(in_flight)
        assert len(q.in_flight) <= budget
    assert q.merged == merged
    # everything accepted is taken exactly once once the device drains
    seen: set[tuple[int, int]] = set()
    while dq or pq or in_flight:
        for k in list(in_flight):
            q.done(Job(k[0], k[1], slot=k[1]))
        in_flight.clear()
        out = q.take()
        assert out or not (dq or pq)
        for j in out:
            assert j.key not in seen
            seen.add(j.key)
            (dq if j.key in dq else pq).remove(j.key)
            in_flight.add(j.key)
        taken += len(out)
    assert taken == accepted


def test_demand_merged_into_queued_prefetch_goes_first() -> None:
    """Regression: a step waits on an expert queued as a prefetch; it must not wait behind other prefetches."""
    q = ReadQueue(1)
    assert q.push(Job(0, 1, 1, ReadClass.PREFETCH))
    assert q.push(Job(0, 2, 2, ReadClass.PREFETCH))
    assert not q.push(Job(0, 2, 2, ReadClass.DEMAND))
    assert [j.expert for j in q.take()] == [2]


def test_merge_into_other_slot_is_a_bug() -> None:
    q = ReadQueue(2)
    q.push(Job(0, 1, 3))
    with pytest.raises(AssertionError):
        q.push(Job(0, 1, 4))
    q.take()
    with pytest.raises(AssertionError):  # in flight too
        q.push(Job(0, 1, 4))


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReadQueue(0)
