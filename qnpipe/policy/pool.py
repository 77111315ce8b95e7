"""The pool's decisions over every layer: grants, the reads they need, and the counters.

`PoolPolicy` is what the pool actor (qnpipe.actors.pool) drives: `acquire` plans a
grant and names the reads to issue; `read_done` says which grants became complete;
`release` ends a grant (and checks the route when asked). It never waits and never
touches a clock: times come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from qnpipe.errors import CapacityError, RouteError
from qnpipe.policy.eviction import Eviction
from qnpipe.policy.slot_table import Load, MissCause, SlotTable

if TYPE_CHECKING:
    from qnpipe.policy.heat import Heat

GrantKey = tuple[int, int, int]  # (step, layer, part)


@attrs.define(slots=True)
class Grant:
    """A grant being assembled or held: `slots[i]` holds `experts[i]`."""

    key: GrantKey
    experts: tuple[int, ...]
    slots: list[int]
    generations: list[int]
    missing: set[int]  # experts whose read is not done yet
    hits: int
    misses: int
    asked_t: float


@attrs.define(slots=True)
class LayerCounters:
    hits: int = 0
    misses: int = 0
    cold: int = 0
    capacity: int = 0
    evictions: int = 0


@attrs.define
class PoolPolicy:
    """Slot tables of every MoE layer and the grants in progress."""

    tables: dict[int, SlotTable]
    record_nbytes: Mapping[int, int]
    pending: dict[GrantKey, Grant] = attrs.field(factory=dict)
    held: dict[GrantKey, Grant] = attrs.field(factory=dict)
    waiters: dict[tuple[int, int], list[GrantKey]] = attrs.field(factory=dict)
    deferred: dict[GrantKey, tuple[tuple[int, ...], float]] = attrs.field(factory=dict)
    counters: dict[int, LayerCounters] = attrs.field(init=False)
    reads: int = 0
    bytes_read: int = 0
    heat: Heat | None = None  # autopin: routing heat, counted at each acquire (qnpipe.policy.heat)

    def __attrs_post_init__(self) -> None:
        self.counters = {layer: LayerCounters() for layer in self.tables}

    @classmethod
    def build(cls, capacities: Mapping[int, int], evictions: Mapping[int, Eviction],
              record_nbytes: Mapping[int, int]) -> PoolPolicy:
        tables = {layer: SlotTable(layer, cap, evictions[layer]) for layer, cap in capacities.items()}
        return cls(tables, record_nbytes)

    def acquire(self, key: GrantKey, experts: Sequence[int], now: float) -> tuple[list[Load], Grant | None]:
        """Plan the grant `key` of `experts`; returns the reads to issue and the grant if complete.

        When the slots it needs are still loading for a cancelled step, the acquire waits
        (no reads, no grant) and `read_done` takes it up again.
        """
        if key in self.pending or key in self.held or key in self.deferred:
            raise AssertionError(f"grant {key} asked for twice")
        if self.heat is not None:  # once per layer-step: a deferred acquire coming back is not counted again
            self.heat.count(key[0], key[1], experts)
        table = self.tables[key[1]]
        # Acquires still deferred at this layer keep their room: one made later must not take it,
        # or they could wait forever once the reads are done.
        if len(experts) > (room := table.room_ever(experts, self.reserved(key[1]))):
            raise CapacityError(
                f"layer {key[1]}: a step needs {len(experts)} distinct experts, {room} of "
                f"{table.capacity} slots are usable (the rest are pinned, held or kept for waiting acquires)"
            )
        if not table.can_acquire_now(experts):
            self.deferred[key] = (tuple(experts), now)
            return [], None
        plan = table.acquire(experts)
        slot_of = dict(plan.hits) | dict(plan.waiting) | {ld.expert: ld.slot for ld in plan.loads}
        slots = [slot_of[e] for e in experts]
        c = self.counters[key[1]]
        c.hits += len(plan.hits)
        c.misses += len(plan.loads) + len(plan.waiting)
        for ld in plan.loads:
            if ld.cause is MissCause.COLD:
                c.cold += 1
            else:
                c.capacity += 1
            c.evictions += ld.evicted >= 0
        grant = Grant(key, tuple(experts), slots, [table.generation[s] for s in slots],
                      {e for e, _ in plan.waiting} | {ld.expert for ld in plan.loads},
                      len(plan.hits), len(plan.loads) + len(plan.waiting), now)
        for e in grant.missing:
            self.waiters.setdefault((key[1], e), []).append(key)
        if grant.missing:
            self.pending[key] = grant
            return list(plan.loads), None
        self.held[key] = grant
        return list(plan.loads), grant

    def reserved(self, layer: int) -> set[int]:
        """Experts of the acquires deferred at `layer`."""
        return {e for k, (experts, _) in self.deferred.items() if k[1] == layer for e in experts}

    def read_done(self, layer: int, expert: int, slot: int) -> tuple[list[Load], list[Grant]]:
        """The read of (`layer`, `expert`) into `slot` finished: the reads and grants that follows."""
        done = self._read_done(layer, expert, slot)
        loads: list[Load] = []
        for key, (experts, asked) in list(self.deferred.items()):
            if key[1] == layer and self.tables[layer].can_acquire_now(experts):
                del self.deferred[key]
                more, g = self.acquire(key, experts, asked)
                loads += more
                if g is not None:
                    done.append(g)
        return loads, done

    def _read_done(self, layer: int, expert: int, slot: int) -> list[Grant]:
        self.tables[layer].loaded(expert, slot)
        self.reads += 1
        self.bytes_read += self.record_nbytes[layer]
        done = []
        for key in self.waiters.pop((layer, expert), []):
            g = self.pending.get(key)
            if g is None:  # released (cancelled) before it was complete
                continue
            g.missing.discard(expert)
            if not g.missing:
                del self.pending[key]
                self.held[key] = g
                done.append(g)
        return done

    def release(self, key: GrantKey, token_experts: Sequence[int] = (), token_slots: Sequence[int] = ()) -> None:
        """End grant `key` (complete, or still pending when its step was cancelled).

        With `token_experts` / `token_slots`, first check that every pair is what the grant
        gave and the table still holds (route verification); RouteError if not.
        """
        if self.deferred.pop(key, None) is not None:
            return
        g = self.held.pop(key, None) or self.pending.pop(key, None)
        if g is None:
            raise AssertionError(f"release of unknown grant {key}")
        table = self.tables[key[1]]
        if token_experts:
            gens = dict(zip(g.slots, g.generations, strict=True))
            if (err := table.verify(token_experts, token_slots, gens)) is not None:
                raise RouteError(f"route verification failed at step {key[0]}: {err}")
        table.release(g.experts)

    def forward_done(self) -> None:
        if self.heat is not None:
            self.heat.forward_done()
        for t in self.tables.values():
            t.forward_done()
