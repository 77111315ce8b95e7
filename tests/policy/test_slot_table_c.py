"""An LFU table's `acquire` in C (cextensions/slot_table.c) against the Python method, op by op.

Two tables, one acquiring in C and one in Python, take the same random operations (acquires, reads done,
releases, pins, prefetches, cancelled loads, forwards with LFU's decay, counts and ticks past 64 bits): after
each, every field of the two tables and of their LFUs is equal, and so are the answers and the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qnpipe.errors import CapacityError
from qnpipe.policy import slot_table
from qnpipe.policy.eviction import LFU, TICK_BITS
from qnpipe.policy.slot_table import FREE, AcquirePlan, SlotState, SlotTable
from tests.profiles import examples

N_EXPERTS = 12


def test_the_c_acquire_is_built() -> None:
    # CI installs with a compiler: the machine below would compare the Python method with itself otherwise.
    assert slot_table._slot_table is not None and slot_table._c_acquire


@contextmanager
def c_acquire(on: bool) -> Iterator[None]:
    saved = slot_table._c_acquire
    slot_table._c_acquire = on
    try:
        yield
    finally:
        slot_table._c_acquire = saved


def state(t: SlotTable) -> tuple[object, ...]:
    lfu = t.eviction
    assert isinstance(lfu, LFU)
    return (dict(t.slot_of), list(t.expert_of), list(t.state), list(t.generation), dict(t.held), set(t.pinned),
            set(t.seen), t.tick, list(t._free), set(t._loading), t._ready,  # pyright: ignore[reportPrivateUsage]
            list(lfu.count.items()), list(lfu.last.items()), list(lfu.key.items()), lfu.forwards)


def outcome(fn: Callable[[], object]) -> object:
    try:
        return ("ok", fn())
    except (CapacityError, AssertionError, ValueError, KeyError) as e:
        return (type(e).__name__, str(e))


class CAgainstPython(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 6), decay=st.sampled_from([0, 1, 3]), big=st.booleans())
    def setup(self, capacity: int, decay: int, big: bool) -> None:
        self.tables = [SlotTable(0, capacity, LFU(decay_interval=decay)) for _ in range(2)]
        if big:  # ticks near the key's tick bits, and a history of counts past what 64 bits hold
            for t in self.tables:
                t.tick = (1 << TICK_BITS) - 3
                assert isinstance(t.eviction, LFU)
                t.eviction.count.update({0: 1 << 40, 1: 1 << 70, 2: 5})
        self.grants: list[tuple[int, ...]] = []

    def both(self, op: Callable[[SlotTable], object]) -> object:
        with c_acquire(True):
            got = outcome(lambda: op(self.tables[0]))
        with c_acquire(False):
            want = outcome(lambda: op(self.tables[1]))
        assert got == want
        return got

    @rule(experts=st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=5, unique=True))
    def acquire(self, experts: list[int]) -> None:
        got = self.both(lambda t: t.acquire(experts))
        assert isinstance(got, tuple)
        if got[0] == "ok":
            assert isinstance(got[1], AcquirePlan)
            self.grants.append(tuple(experts))

    @precondition(lambda self: bool(self.tables[0]._loading))  # pyright: ignore[reportPrivateUsage]
    @rule(data=st.data())
    def read_done(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(sorted(self.tables[0]._loading)))  # pyright: ignore[reportPrivateUsage]
        slot = self.tables[0].slot_of[e]
        self.both(lambda t: t.loaded(e, slot))

    @precondition(lambda self: bool(self.grants))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        g = self.grants.pop(data.draw(st.integers(0, len(self.grants) - 1)))
        self.both(lambda t: t.release(g))

    @rule(e=st.integers(0, N_EXPERTS - 1))
    def pin_or_unpin(self, e: int) -> None:
        if e in self.tables[0].pinned:
            self.both(lambda t: t.unpin(e))
        else:
            self.both(lambda t: t.pin(e))

    @rule(e=st.integers(0, N_EXPERTS - 1))
    def prefetch(self, e: int) -> None:
        self.both(lambda t: t.prefetch(e))

    @precondition(lambda self: any(not t.held.get(e) for t in self.tables[:1]
                                   for e in t._loading))  # pyright: ignore[reportPrivateUsage]
    @rule(data=st.data())
    def cancel_load(self, data: st.DataObject) -> None:
        t0 = self.tables[0]
        e = data.draw(st.sampled_from(sorted(e for e in t0._loading  # pyright: ignore[reportPrivateUsage]
                                             if not t0.held.get(e))))
        slot = t0.slot_of[e]
        self.both(lambda t: t.cancel_load(e, slot))

    @rule()
    def forward_done(self) -> None:
        self.both(lambda t: t.forward_done())

    @invariant()
    def the_tables_are_equal(self) -> None:
        if hasattr(self, "tables"):
            assert state(self.tables[0]) == state(self.tables[1])


TestCAgainstPython = CAgainstPython.TestCase
TestCAgainstPython.settings = settings(examples(200), stateful_step_count=50)


def test_a_step_past_the_room_is_refused_in_c_with_nothing_changed() -> None:
    t = SlotTable(3, 2, LFU())
    t.acquire([0, 1])
    before = state(t)
    with c_acquire(True), pytest.raises(CapacityError, match="layer 3: a step needs 2 distinct experts, 0 of 2"):
        t.acquire([4, 5])
    assert state(t) == before


def test_the_c_acquire_evicts_the_least_key_and_counts_the_load_as_the_method_does() -> None:
    with c_acquire(True):
        t = SlotTable(0, 3, LFU())
        t.acquire([0, 1, 2])
        for e in (0, 1, 2):
            t.loaded(e, t.slot_of[e])
        t.release([0, 1, 2])
        t.acquire([0, 2])  # 0 and 2 used twice: 1 is the least frequent
        t.release([0, 2])
        plan = t.acquire([1, 5])  # 1 is held now: the least of the rest (0 before 2: same count, older)
    assert [(ld.expert, ld.evicted) for ld in plan.loads] == [(5, 0)]
    assert plan.hits == ((1, t.slot_of[1]),) and t.state[t.slot_of[5]] is SlotState.LOADING
    assert t.generation[t.slot_of[5]] == 2 and FREE not in t.expert_of
