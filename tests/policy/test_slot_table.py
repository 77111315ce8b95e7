"""SlotTable rules (qnpipe/policy/slot_table.py), driven by hypothesis.

- a RuleBasedStateMachine checks capacity, holds, pins, reads in flight, one Load per
  miss with one cause, and that CapacityError is raised exactly when the step cannot fit;
- a differential test checks SlotTable + eviction.LRU against a 20-line reference LRU;
- route verification catches a wrong slot and a rewritten slot;
- no eviction policy ever picks a victim outside the candidates it is given.

`victim` is the reference `pick` is checked against: for the score policies the plain minimum,
for CLOCK and SIEVE the closed form of where their hand stops (lowest counter, oldest first;
first unvisited from the hand on), for ARC and S3-FIFO their search run on copies of their
lists. A queue policy's `pick` moves its hand or queues, so the reference is taken first.
Their agreement with libCacheSim is tests/policy/test_libcachesim.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from qnpipe.config import EvictPolicy
from qnpipe.errors import CapacityError
from qnpipe.policy.eviction import LRU, Eviction, make_eviction
from qnpipe.policy.slot_table import FREE, LoadCause, SlotState, SlotTable
from tests.profiles import examples

N_EXPERTS = 12
POLICIES = list(EvictPolicy)


@attrs.define
class Spy:
    """Wraps a policy; checks every victim is one of the candidates, and the candidates are evictable."""

    inner: Eviction
    table: SlotTable | None = None
    victims: int = 0
    many: int = 0  # pick_many calls

    def inserted(self, expert: int, tick: int) -> None:
        self.inner.inserted(expert, tick)

    def accessed(self, expert: int, tick: int) -> None:
        self.inner.accessed(expert, tick)

    def removed(self, expert: int) -> None:
        self.inner.removed(expert)

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        cands = list(candidates)
        assert cands, "the table asked for a victim among no candidates"
        t = self.table
        assert t is not None
        for e in cands:
            assert e not in t.held and e not in t.pinned and t.state[t.slot_of[e]] is SlotState.READY, e
        v = self.inner.victim(cands, incoming)
        assert v in cands, (v, cands)
        self.victims += 1
        return v

    @property
    def pick_many(self) -> Any:
        """The inner policy's `pick_many` (absent when it has none), which must give its victims in a row."""
        inner = self.inner.pick_many  # type: ignore[attr-defined]  # AttributeError: the table picks one by one

        def many(n: int, loading: Collection[int], held: Collection[int], pinned: Collection[int]) -> list[int]:
            t = self.table
            assert t is not None
            evictable = [e for e in t.slot_of if e not in loading and e not in held and e not in pinned]
            want = []
            for _ in range(min(n, len(evictable))):
                want.append(self.victim(evictable, -1))
                evictable.remove(want[-1])
            got = inner(n, loading, held, pinned)
            assert got == want, (got, want)
            self.many += 1
            return got
        return many

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        """The inner policy's pick, which must be its `victim` among the table's evictable experts."""
        t = self.table
        assert t is not None
        assert incoming not in t.slot_of, incoming
        evictable = [e for e in t.slot_of if e not in loading and e not in held and e not in pinned]
        want = self.victim(evictable, incoming) if evictable else None
        got = self.inner.pick(loading, held, pinned, incoming)
        assert got == want, (got, evictable)
        return got

    def forward_done(self) -> None:
        self.inner.forward_done()


def spied_table(capacity: int, kind: EvictPolicy, decay: int = 0, lam: float = 0.05) -> tuple[SlotTable, Spy]:
    spy = Spy(make_eviction(kind, capacity, lfu_decay_interval=decay, lrfu_lambda=lam))
    table = SlotTable(0, capacity, spy)
    spy.table = table
    return table, spy


def snapshot(t: SlotTable) -> tuple[object, ...]:
    return (dict(t.slot_of), list(t.expert_of), list(t.state), list(t.generation), dict(t.held),
            set(t.pinned), set(t.seen), t.tick)


class SlotTableMachine(RuleBasedStateMachine):
    """Random acquire / loaded / release / pin / unpin / forward_done against a model of the rules."""

    grants = Bundle("grants")

    @initialize(capacity=st.integers(1, 6), kind=st.sampled_from(POLICIES), decay=st.sampled_from([0, 2]),
                lam=st.sampled_from([0.01, 0.2, 1.0]))
    def setup(self, capacity: int, kind: EvictPolicy, decay: int, lam: float) -> None:
        self.table, self.spy = spied_table(capacity, kind, decay, lam)
        self.capacity = capacity
        self.loading: dict[int, int] = {}  # expert -> slot, reads issued and not done (model)
        self.held: dict[int, int] = {}  # expert -> holds (model)
        self.pinned: set[int] = set()
        self.seen: set[int] = set()
        self.resident: set[int] = set()  # experts in the pool, READY or loading (model)

    def blocked_for(self, need: set[int]) -> set[int]:
        return {e for e in (self.pinned | set(self.held) | set(self.loading)) if e not in need}

    @rule(target=grants, experts=st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=4, unique=True))
    def acquire(self, experts: list[int]) -> tuple[int, ...]:
        t = self.table
        fits = len(experts) <= self.capacity - len(self.blocked_for(set(experts)))
        before = snapshot(t)
        if not fits:
            with pytest.raises(CapacityError):
                t.acquire(experts)
            assert snapshot(t) == before, "a refused acquire changed the table"
            return ()
        plan = t.acquire(experts)  # must not raise: the model says the step fits
        hits = [e for e, _ in plan.hits]
        waiting = [e for e, _ in plan.waiting]
        loads = [ld.expert for ld in plan.loads]
        # every requested expert is exactly one of hit / waiting / load
        assert sorted(hits + waiting + loads) == sorted(experts)
        assert set(hits) == {e for e in experts if e in self.resident and e not in self.loading}
        assert set(waiting) == {e for e in experts if e in self.loading}
        assert set(loads) == {e for e in experts if e not in self.resident}
        for e, s in plan.hits + plan.waiting:
            assert t.slot_of[e] == s and t.expert_of[s] == e
        for ld in plan.loads:
            assert ld.cause is (LoadCause.CAPACITY if ld.expert in self.seen else LoadCause.COLD)
            if ld.evicted != FREE:
                assert ld.evicted in self.resident
                assert ld.evicted not in self.held, "evicted a held expert"
                assert ld.evicted not in self.pinned, "evicted a pinned expert"
                assert ld.evicted not in self.loading, "evicted an expert whose read is in flight"
                assert ld.evicted not in experts
                self.resident.discard(ld.evicted)
            else:
                assert len(self.resident) < self.capacity, "took a free slot the model says is not there"
            self.seen.add(ld.expert)
            self.resident.add(ld.expert)
            self.loading[ld.expert] = ld.slot
            assert t.state[ld.slot] is SlotState.LOADING
        for e in experts:
            self.held[e] = self.held.get(e, 0) + 1
        return tuple(experts)

    @precondition(lambda self: bool(self.loading))
    @rule(data=st.data())
    def read_done(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(sorted(self.loading)))
        slot = self.loading.pop(e)
        self.table.loaded(e, slot)
        with pytest.raises(AssertionError):  # a second completion of the same read is refused
            self.table.loaded(e, slot)

    @rule(experts=consumes(grants))
    def release(self, experts: tuple[int, ...]) -> None:
        self.table.release(experts)
        for e in experts:
            self.held[e] -= 1
            if not self.held[e]:
                del self.held[e]

    @precondition(lambda self: bool(self.resident))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(sorted(self.resident)))
        self.table.pin(e)
        self.pinned.add(e)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(sorted(self.pinned)))
        self.table.unpin(e)
        self.pinned.discard(e)

    @rule()
    def forward_done(self) -> None:
        self.table.forward_done()

    @invariant()
    def capacity_never_exceeded(self) -> None:
        t = self.table
        assert t.occupancy <= self.capacity
        assert len(t.slot_of) == sum(s is not SlotState.FREE for s in t.state)

    @invariant()
    def table_matches_model(self) -> None:
        t = self.table
        assert set(t.slot_of) == self.resident
        for e, s in t.slot_of.items():
            assert t.expert_of[s] == e
            assert t.state[s] is (SlotState.LOADING if e in self.loading else SlotState.READY)
        assert set(self.held) <= set(t.slot_of), "a held expert left the pool"
        assert self.pinned <= set(t.slot_of), "a pinned expert left the pool"
        assert t.held == self.held and t.pinned == self.pinned


    @invariant()
    def room_checks_match_a_full_scan(self) -> None:
        # available_for / can_acquire_now keep counters instead of scanning: they must equal the scan.
        t = self.table
        for need in (set(), set(t.slot_of) & {0, 1, 2}, {0, 3, 5, 7}):
            blocked = {e for e in t.pinned | set(t.held) if e not in need}
            blocked |= {e for e, s in t.slot_of.items() if t.state[s] is SlotState.LOADING and e not in need}
            assert t.available_for(need) == self.capacity - len(blocked)
            missing = sum(e not in t.slot_of for e in need)
            free = self.capacity - len(t.slot_of)
            evictable = sum(1 for e, s in t.slot_of.items() if t.state[s] is SlotState.READY
                            and e not in t.held and e not in t.pinned and e not in need)
            assert t.can_acquire_now(sorted(need)) == (missing <= free + evictable)
            if not t.loading_any():  # PoolPolicy._admit then skips can_acquire_now after the room check
                assert t.can_acquire_now(sorted(need)) == (len(need) <= t.room_ever(need))

TestSlotTableMachine = SlotTableMachine.TestCase
# more: the state machine's rule orders are many
TestSlotTableMachine.settings = settings(examples(150), stateful_step_count=40)


def test_loading_unheld_expert_blocks_its_slot() -> None:
    """Regression: a cancelled step leaves a read in flight and no hold; that slot is not usable."""
    t = SlotTable(0, 2, LRU())
    t.acquire([0])
    t.release([0])  # step cancelled, read of 0 still in flight
    before = snapshot(t)
    with pytest.raises(CapacityError):
        t.acquire([1, 2])
    assert snapshot(t) == before


# ---------------------------------------------------------------- differential LRU


class RefLRU:
    """Reference LRU over steps: hits move to the back, misses evict the front non-step entry."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def step(self, experts: Sequence[int]) -> list[tuple[int, bool, int]]:
        """(expert, hit, evicted or FREE) per expert: hits first in order, then misses in order."""
        out = []
        for e in experts:
            if e in self.d:
                self.d.move_to_end(e)
                out.append((e, True, FREE))
        for e in experts:
            if e in self.d:
                continue
            evicted = FREE
            if len(self.d) == self.capacity:
                evicted = next(x for x in self.d if x not in experts)
                del self.d[evicted]
            self.d[e] = None
            out.append((e, False, evicted))
        return out


def run_table(capacity: int, steps: Sequence[Sequence[int]]) -> list[list[tuple[int, bool, int]]]:
    t = SlotTable(0, capacity, LRU())
    trace = []
    for experts in steps:
        plan = t.acquire(experts)
        assert not plan.waiting
        row = [(e, True, FREE) for e, _ in plan.hits] + [(ld.expert, False, ld.evicted) for ld in plan.loads]
        for ld in plan.loads:
            t.loaded(ld.expert, ld.slot)
        t.release(experts)
        trace.append(row)
    return trace


# more: a pure table, cheap, with a wide input space
@examples(200)
@given(capacity=st.integers(1, 8), seq=st.lists(st.integers(0, 15), max_size=120))
def test_lru_matches_reference_one_expert_per_step(capacity: int, seq: list[int]) -> None:
    ref = RefLRU(capacity)
    assert run_table(capacity, [[e] for e in seq]) == [ref.step([e]) for e in seq]


# more: a pure table, cheap, with a wide input space
@examples(200)
@given(data=st.data(), k=st.integers(1, 4), extra=st.integers(0, 6))
def test_lru_matches_reference_multi_expert_steps(data: st.DataObject, k: int, extra: int) -> None:
    capacity = k + extra
    steps = data.draw(st.lists(st.lists(st.integers(0, 19), min_size=1, max_size=k, unique=True), max_size=60))
    ref = RefLRU(capacity)
    assert run_table(capacity, steps) == [ref.step(s) for s in steps]


# ---------------------------------------------------------------- route verification


def granted(t: SlotTable, experts: list[int]) -> tuple[list[int], dict[int, int]]:
    plan = t.acquire(experts)
    for ld in plan.loads:
        t.loaded(ld.expert, ld.slot)
    slot_of = dict(plan.hits) | {ld.expert: ld.slot for ld in plan.loads}
    slots = [slot_of[e] for e in experts]
    return slots, {s: t.generation[s] for s in slots}


# more: a pure table, cheap, with a wide input space
@examples(150)
@given(capacity=st.integers(2, 6), data=st.data())
def test_verify_catches_wrong_slot(capacity: int, data: st.DataObject) -> None:
    t = SlotTable(0, capacity, LRU())
    experts = data.draw(st.lists(st.integers(0, 9), min_size=2, max_size=capacity, unique=True))
    slots, gens = granted(t, experts)
    assert t.verify(experts, slots, gens) is None
    i = data.draw(st.integers(0, len(experts) - 1))
    bad = data.draw(st.integers(-2, capacity + 1).filter(lambda s: s != slots[i]))
    wrong = list(slots)
    wrong[i] = bad
    assert t.verify(experts, wrong, gens) is not None


def test_verify_catches_rewritten_slot() -> None:
    """Same expert back in the same slot, but rewritten since the grant: the generation differs."""
    t = SlotTable(0, 1, LRU())
    slots, gens = granted(t, [3])
    t.release([3])
    granted(t, [4])  # evicts 3 from slot 0
    t.release([4])
    slots2, _ = granted(t, [3])  # 3 returns to slot 0
    assert slots2 == slots and t.expert_of[slots[0]] == 3
    err = t.verify([3], slots, gens)
    assert err is not None and "rewritten" in err
    assert t.verify([3], slots, {slots[0]: t.generation[slots[0]]}) is None


def test_verify_catches_slot_still_loading() -> None:
    t = SlotTable(0, 2, LRU())
    plan = t.acquire([5])
    (ld,) = plan.loads
    assert t.verify([5], [ld.slot], {ld.slot: t.generation[ld.slot]}) is not None


# ---------------------------------------------------------------- eviction policies alone


# more: a pure table, cheap, with a wide input space
@examples(200)
@given(kind=st.sampled_from(POLICIES), lam=st.sampled_from([0.01, 0.05, 0.2, 1.0]), decay=st.sampled_from([0, 1, 3]),
       capacity=st.integers(1, 10),
       ops=st.lists(st.tuples(st.sampled_from(["touch", "evict", "fwd"]), st.integers(0, 9)), max_size=80),
       data=st.data())
def test_victim_is_always_a_candidate(kind: EvictPolicy, lam: float, decay: int, capacity: int,
                                      ops: list[tuple[str, int]], data: st.DataObject) -> None:
    pol = make_eviction(kind, capacity, lfu_decay_interval=decay, lrfu_lambda=lam)
    resident: set[int] = set()
    tick = 0
    for op, e in ops:
        tick += 1
        if op == "touch":
            (pol.accessed if e in resident else pol.inserted)(e, tick)
            resident.add(e)
        elif op == "fwd":
            pol.forward_done()
        elif resident:
            cands = data.draw(st.lists(st.sampled_from(sorted(resident)), min_size=1, unique=True))
            incoming = data.draw(st.integers(0, 15).filter(lambda x: x not in resident))
            v = pol.victim(iter(cands), incoming)
            assert v in cands
            # pick, with every resident but the candidates blocked, finds the same victim without a scan
            assert pol.pick(resident - set(cands), (), (), incoming) == v
            want = pol.victim(iter(sorted(resident)), incoming)
            assert pol.pick((), (), (), incoming) == want
            pol.removed(v)
            resident.discard(v)


class OneByOne(Spy):
    """The same checks, as a policy without `pick_many`: the table then picks each victim on its own."""

    @property
    def pick_many(self) -> Any:
        raise AttributeError("pick_many")


@pytest.mark.parametrize(("capacity", "universe", "most"), [(6, N_EXPERTS, 5), (160, 400, 40)])
def test_an_acquires_victims_chosen_at_once_are_those_chosen_one_by_one(capacity: int, universe: int,
                                                                         most: int) -> None:
    # LFU.pick_many: the misses past the free slots get the n least keys, as n picks in a row would (a sort up to
    # 128 evictable keys, `heapq.nsmallest` past that: the second case takes both).
    rng = __import__("random").Random(5)
    spy, one = Spy(make_eviction(EvictPolicy.LFU, capacity)), OneByOne(make_eviction(EvictPolicy.LFU, capacity))
    batched, single = SlotTable(0, capacity, spy), SlotTable(0, capacity, one)
    spy.table, one.table = batched, single
    for _ in range(300):
        experts = rng.sample(range(universe), rng.randint(1, most))
        plans = [t.acquire(experts) for t in (batched, single)]
        assert plans[0] == plans[1]
        for t, plan in zip((batched, single), plans, strict=True):
            for ld in plan.loads:
                t.loaded(ld.expert, ld.slot)
            t.release(experts)
    assert spy.many > 20 and one.many == 0  # the batched search really ran, and only there
