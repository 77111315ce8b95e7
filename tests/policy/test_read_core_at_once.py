"""`ReadCore.batch_at_once` (qnpipe/policy/read_core.py): the batch it names before a turn is the turn's first,
in every queue state the operations below reach; when it names none, putting one on the device first would be
wrong or is not known (a merge, a demand queued ahead, no room, a prefetch or more than one message)."""

from __future__ import annotations

import copy
import math

from hypothesis import example, given
from hypothesis import strategies as st

from qnpipe.messages import ReadExperts
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.read_core import BatchDone, ReadCore
from qnpipe.policy.read_queue import Job, ReadClass, ReadQueue
from tests.profiles import examples

EXPERTS = st.lists(st.integers(0, 5), min_size=0, max_size=4)  # duplicates at times: they merge
OPS = st.lists(st.one_of(
    st.tuples(st.just("ask"), st.integers(0, 1), EXPERTS, st.sampled_from(ReadClass)),
    st.tuples(st.just("done"), st.none(), st.none(), st.none()),
), max_size=30)


def _ask(layer: int, experts: list[int], cls: ReadClass, t: float) -> ReadExperts:
    deadline = math.inf if cls is ReadClass.DEMAND else t + 1.0
    return ReadExperts(t=t, seq=1, layer=layer, experts=tuple(experts), slots=tuple(experts), cls=cls,
                       deadline=deadline, scores=tuple(0.5 for _ in experts) if cls is ReadClass.PREFETCH else ())


@examples(300)
@given(budget=st.integers(1, 4), batch=st.booleans(), cap=st.sampled_from([None, 1]), ops=OPS,
       layer=st.integers(0, 1), last=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       cls=st.sampled_from([ReadClass.DEMAND] * 3 + [ReadClass.PREFETCH]), two=st.sampled_from([False] * 3 + [True]))
# a demand for a prefetch queued behind the cap, for a read in flight, and for the same expert twice: each merges
@example(budget=4, batch=True, cap=1, ops=[("ask", 0, [1, 2], ReadClass.PREFETCH)], layer=0, last=[3, 2],
         cls=ReadClass.DEMAND, two=False)
@example(budget=4, batch=True, cap=None, ops=[("ask", 0, [1], ReadClass.DEMAND)], layer=0, last=[1],
         cls=ReadClass.DEMAND, two=False)
@example(budget=4, batch=True, cap=None, ops=[], layer=1, last=[2, 2], cls=ReadClass.DEMAND, two=False)
def test_the_batch_known_before_a_turn_is_its_first(budget: int, batch: bool, cap: int | None, ops: list, layer: int,
                                                   last: list[int], cls: ReadClass, two: bool) -> None:
    # `cap` keeps prefetches queued while the budget has room: a demand for one of them merges
    core = ReadCore(ReadQueue(budget, batch=batch, max_prefetch_in_flight=cap))
    on_device: list[Outbox] = []
    t = 0.0
    for op, lay, experts, c in ops:
        t += 0.1
        if op == "ask":
            # one slot per expert, as the pool would give; an expert asked again while queued merges
            fresh = [e for e in dict.fromkeys(experts) if (lay, e) not in core.queue.in_flight]
            on_device.append(core.turn([_ask(lay, fresh, c, t)], t))
        elif on_device and on_device[0].batches:
            b = on_device[0].batches.pop(0)
            on_device.append(core.turn([BatchDone(b, [1] * len(b.jobs))], t))
        elif on_device:
            on_device.pop(0)
    msgs = [_ask(layer, last, cls, t + 0.1)]
    if two:
        msgs.append(_ask(1 - layer, [0], ReadClass.DEMAND, t + 0.1))
    before = copy.deepcopy(core)
    jobs = core.batch_at_once(msgs)
    assert core.queue == before.queue and core.issued == before.issued  # asking changes nothing
    out = core.turn(msgs, t + 0.1)
    if jobs is not None:
        assert out.batches and out.batches[0].jobs == jobs
        assert cls is ReadClass.DEMAND and not two and jobs == [Job(layer, e, e) for e in last]
    elif cls is ReadClass.DEMAND and not two and last:
        # not known: a demand queued ahead, a merge (queued, in flight or twice), or no room for all at once
        q = before.queue
        room = q.max_in_flight - len(q.in_flight)
        assert q.demand or len(last) > (room if batch else min(room, 1)) or len(set(last)) < len(last) or any(
            (layer, e) in q.queued or (layer, e) in q.in_flight for e in last)
