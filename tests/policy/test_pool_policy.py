"""PoolPolicy (qnpipe/policy/pool.py) over two layers, driven by a RuleBasedStateMachine.

Grants complete only when all their reads are done, released pending grants never
complete, every miss is read once, the counters add up, and route verification passes
for what a grant gave and fails for anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qnpipe.config import EvictPolicy
from qnpipe.errors import CapacityError, RouteError
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.pool import GrantKey, PoolPolicy
from qnpipe.policy.slot_table import SlotState
from tests.profiles import examples

LAYERS = (0, 5)
N_EXPERTS = 10


class PoolMachine(RuleBasedStateMachine):
    @initialize(caps=st.tuples(st.integers(1, 5), st.integers(1, 5)),
                kind=st.sampled_from(list(EvictPolicy)))
    def setup(self, caps: tuple[int, int], kind: EvictPolicy) -> None:
        capacities: dict[int, int] = dict(zip(LAYERS, caps, strict=True))
        self.policy = PoolPolicy.build(capacities, {layer: make_eviction(kind, capacities[layer]) for layer in LAYERS},
                                       {layer: 100 + layer for layer in LAYERS})
        self.step = 0
        self.reads: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot: issued, not done
        self.waits: dict[GrantKey, set[int]] = {}  # model: experts each pending grant waits for
        self.complete: set[GrantKey] = set()  # grants handed out (complete, not released)
        self.released: set[GrantKey] = set()
        self.experts: dict[GrantKey, tuple[int, ...]] = {}
        self.deferred: dict[GrantKey, tuple[int, ...]] = {}
        self.loads = {layer: 0 for layer in LAYERS}
        self.requested = {layer: 0 for layer in LAYERS}
        self.reads_done = 0

    @rule(layer=st.sampled_from(LAYERS),
          experts=st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=3, unique=True))
    def acquire(self, layer: int, experts: list[int]) -> None:
        self.step += 1
        key = (self.step, layer, 0)
        try:
            r = self.policy.acquire(key, experts, now=float(self.step))
            loads, grant = list(r.loads), r.ready
        except CapacityError:
            table = self.policy.tables[layer]
            waiting = {e for k, ex in self.deferred.items() if k[1] == layer for e in ex}
            assert len(experts) > table.room_ever(experts, waiting)
            return
        if key in self.policy.deferred:  # its slots are still loading for a cancelled step: it waits
            assert not loads and grant is None
            assert not self.policy.tables[layer].can_acquire_now(experts)
            self.deferred[key] = tuple(experts)
            return
        self._acquired(key, experts, loads, grant)

    def _acquired(self, key: GrantKey, experts: Sequence[int], loads: list, grant: object) -> None:
        layer = key[1]
        self.requested[layer] += len(experts)
        self.loads[layer] += len(loads)
        for ld in loads:
            assert (layer, ld.expert) not in self.reads, "a second read of an expert already being read"
            self.reads[(layer, ld.expert)] = ld.slot
        in_flight = {e for (lay, e) in self.reads if lay == layer}
        missing = {e for e in experts if e in in_flight}
        self.experts[key] = tuple(experts)
        if grant is None:
            assert missing, "a grant with every expert resident was not complete"
            self.waits[key] = missing
        else:
            assert not missing, "a grant was complete while one of its reads was in flight"
            assert grant.key == key and grant.experts == tuple(experts)  # type: ignore[attr-defined]
            self.complete.add(key)

    @precondition(lambda self: bool(self.reads))
    @rule(data=st.data())
    def read_done(self, data: st.DataObject) -> None:
        layer, expert = data.draw(st.sampled_from(sorted(self.reads)))
        self._read_done(layer, expert)

    def _read_done(self, layer: int, expert: int) -> None:
        slot = self.reads.pop((layer, expert))
        r = self.policy.read_done(layer, expert, slot)
        loads, done = list(r.loads), list(r.grants)
        self.reads_done += 1
        expect = set()
        for key, w in list(self.waits.items()):
            if key[1] == layer:
                w.discard(expert)
                if not w:
                    expect.add(key)
                    del self.waits[key]
        # Deferred acquires taken up now: as if they had just been made.
        resumed = [k for k in self.deferred if k not in self.policy.deferred]
        resumed_done = {g.key for g in done if g.key in resumed}
        for k in resumed:  # retried in the order they were deferred: the first to need a miss reads it
            experts = self.deferred.pop(k)
            mine = [ld for ld in loads if ld.expert in experts]
            self._acquired(k, experts, mine, next((g for g in done if g.key == k), None))
            loads = [ld for ld in loads if ld not in mine]
        assert not loads, "reads issued for no acquire"
        got = {g.key for g in done} - resumed_done
        assert len({g.key for g in done}) == len(done)
        assert not (got & self.released), "a released pending grant completed"
        assert got == expect, "grants completed != grants whose reads are all done"
        self.complete |= got

    @precondition(lambda self: bool(self.complete))
    @rule(data=st.data(), verify=st.booleans())
    def release_complete(self, data: st.DataObject, verify: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.complete)))
        g = self.policy.held[key]
        if verify:
            # tokens use any subset of the grant's (expert, slot) pairs: verification passes
            pairs = data.draw(st.lists(st.sampled_from(list(zip(g.experts, g.slots, strict=True))), min_size=1))
            self.policy.release(key, [e for e, _ in pairs], [s for _, s in pairs])
        else:
            self.policy.release(key)
        self.complete.discard(key)
        self.released.add(key)

    @precondition(lambda self: bool(self.complete))
    @rule(data=st.data())
    def bad_route_is_caught(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.complete)))
        g = self.policy.held[key]
        cap = self.policy.tables[key[1]].capacity
        i = data.draw(st.integers(0, len(g.slots) - 1))
        bad = data.draw(st.integers(0, cap).filter(lambda s: s != g.slots[i]))
        slots = list(g.slots)
        slots[i] = bad
        with pytest.raises(RouteError):
            self.policy.release(key, list(g.experts), slots)
        self.complete.discard(key)  # the grant is gone (popped) before the check failed
        self.released.add(key)
        # the failed release left its holds: drop them as the engine's crash path would
        self.policy.tables[key[1]].release(g.experts)

    @precondition(lambda self: bool(self.waits) or bool(self.deferred))
    @rule(data=st.data())
    def cancel_pending(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.waits | self.deferred)))
        self.policy.release(key)
        self.waits.pop(key, None)
        self.deferred.pop(key, None)
        self.released.add(key)

    @rule()
    def forward_done(self) -> None:
        self.policy.forward_done()

    @invariant()
    def books_balance(self) -> None:
        p = self.policy
        assert set(p.pending) == set(self.waits)
        assert set(p.deferred) == set(self.deferred)
        assert set(p.held) == self.complete
        for key, g in p.pending.items():
            assert g.missing == self.waits[key]
        for layer in LAYERS:
            c = p.counters[layer]
            assert c.cold + c.capacity == self.loads[layer], "each load has exactly one cause"
            assert c.hits + c.misses == self.requested[layer]
            assert p.tables[layer].occupancy <= p.tables[layer].capacity
        # The reads the policy asked for and was not told are done are its tables' slots being read (the
        # read side counts reads and bytes; the policy keeps no count of its own).
        loading = {(layer, e) for layer, t in p.tables.items() for e, s in t.slot_of.items()
                   if t.state[s] is SlotState.LOADING}
        assert loading == set(self.reads)
        assert sum(c.cold + c.capacity for c in p.counters.values()) - self.reads_done == len(self.reads)

    def teardown(self) -> None:
        if not hasattr(self, "policy"):
            return
        # liveness: once every read is done, nothing that was not released is still pending
        while self.reads:
            self._read_done(*min(self.reads))
        assert not self.policy.pending and not self.policy.deferred


TestPoolMachine = PoolMachine.TestCase
# more: the state machine's rule orders are many
TestPoolMachine.settings = settings(examples(150), stateful_step_count=40)


def test_statistics_sum_the_layers_and_stay_frozen() -> None:
    policy = PoolPolicy.build({0: 2, 1: 2}, {ly: make_eviction(EvictPolicy.LRU, 2) for ly in (0, 1)}, {0: 8, 1: 8})
    for step, (layer, experts) in enumerate([(0, [1, 2]), (1, [3]), (0, [1, 4])]):
        key = (step, layer, 0)
        for ld in policy.acquire(key, experts, float(step)).loads:
            policy.read_done(layer, ld.expert, ld.slot)
        policy.release(key)
    snap = policy.statistics()
    assert (snap.hits, snap.misses, snap.requests) == (1, 4, 5)  # expert 1 hits the second time
    assert snap.misses == sum(snap.causes.values()) and snap.layers[0].misses == 3 and snap.layers[1].misses == 1
    policy.counters[0].misses += 10  # the snapshot is detached from the live counters
    assert snap.layers[0].misses == 3
    with pytest.raises(AttributeError):
        snap.hits = 0  # type: ignore[misc]
