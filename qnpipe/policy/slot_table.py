"""One MoE layer's slot table: which expert each slot holds, pins, holds, and misses.

The pool actor asks `acquire` for the experts one step needs at this layer and gets
the hits, the misses it must read (each with the slot it goes to and the expert that
slot gives up), and the experts already on their way. Rules (hypothesis-tested in
tests/policy/test_slot_table.py):

- at most `capacity` experts are resident or loading;
- a held expert (granted to a step that has not released it) is never evicted, nor is
  a pinned one, nor one whose read is still in flight;
- every slot write bumps the slot's generation, so a grant can be checked later
  (route verification) against the slot still holding what it held.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence

import attrs
import msgspec

from qnpipe.errors import CapacityError
from qnpipe.policy.eviction import LFU, TICK_BITS, Eviction

try:  # the optional C build (setup.py); without it, the method below does the same
    import qnpipe.policy._slot_table as _slot_table  # pyright: ignore[reportMissingImports]
except ImportError:  # pragma: no cover - the CI build has it
    _slot_table = None

FREE = -1
# An LFU table's `acquire` in C (cextensions/slot_table.c) when it is built: the same steps on the same objects.
# False: the Python method (the tests that hold the two equal, A/B benchmarks).
_c_acquire = _slot_table is not None


class LoadCause(enum.StrEnum):
    """Why a demand load's expert was not resident: the table's view (the pool's attribution, with
    prefetch in the picture, is qnpipe.policy.pool_counters.MissKind)."""

    COLD = "cold"  # never in this layer's pool before
    CAPACITY = "capacity"  # was resident, evicted to make room


MissCause = LoadCause  # its old name, beside MissKind it misled


class SlotState(enum.IntEnum):
    FREE = 0
    LOADING = 1
    READY = 2


class Load(msgspec.Struct, frozen=True):
    """A miss: read `expert` into `slot`; `evicted` is the expert the slot held (FREE = none). A frozen
    msgspec Struct: made in C, six times an acquire on the miss path (an attrs class's `__init__` is Python)."""

    expert: int
    slot: int
    evicted: int
    cause: LoadCause


class AcquirePlan(msgspec.Struct, frozen=True):
    """The answer to `acquire`: hits (expert, slot), loads to issue, and experts already loading."""

    hits: tuple[tuple[int, int], ...]
    loads: tuple[Load, ...]
    waiting: tuple[tuple[int, int], ...]  # (expert, slot) whose read is in flight

    @property
    def ready(self) -> bool:
        return not self.loads and not self.waiting


@attrs.define(slots=True)
class SlotTable:
    """The slot table of MoE layer `layer` with `capacity` slots."""

    layer: int
    capacity: int
    eviction: Eviction
    expert_of: list[int] = attrs.field(init=False)
    state: list[SlotState] = attrs.field(init=False)
    generation: list[int] = attrs.field(init=False)
    slot_of: dict[int, int] = attrs.field(init=False, factory=dict)
    held: dict[int, int] = attrs.field(init=False, factory=dict)  # expert -> number of holds
    pinned: set[int] = attrs.field(init=False, factory=set)
    seen: set[int] = attrs.field(init=False, factory=set)
    tick: int = attrs.field(init=False, default=0)
    _free: list[int] = attrs.field(init=False)
    # Kept with `state` so the per-acquire checks need not scan every slot (replay runs them per layer-step).
    _loading: set[int] = attrs.field(init=False, factory=set)  # experts whose read is in flight
    _ready: int = attrs.field(init=False, default=0)  # slots READY

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1:
            raise CapacityError(f"layer {self.layer}: capacity {self.capacity}, need at least 1 slot")
        self.expert_of = [FREE] * self.capacity
        self.state = [SlotState.FREE] * self.capacity
        self.generation = [0] * self.capacity
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out slot 0 first

    # ----------------------------------------------------------------- queries

    def resident(self) -> dict[int, int]:
        """expert -> slot of every READY expert."""
        return {e: s for e, s in self.slot_of.items() if self.state[s] is SlotState.READY}

    @property
    def occupancy(self) -> int:
        """Slots resident or loading."""
        return len(self.slot_of)

    def room_ever(self, experts: Iterable[int], reserved: Iterable[int] = ()) -> int:
        """Slots a step needing `experts` could use once reads in flight finish: capacity minus pins,
        holds and `reserved` (experts of acquires still waiting, which will hold them)."""
        if not self.pinned and not self.held and not reserved:
            return self.capacity
        need = set(experts)
        return self.capacity - len((self.pinned | self.held.keys() | set(reserved)) - need)

    def loading_any(self) -> bool:
        """Whether a read into this table is in flight. With none, a step whose `room_ever` (whatever it
        reserves) fits its experts `can_acquire_now`: every pinned or held expert has a slot, and every slot
        taken is READY."""
        return bool(self._loading)

    def available_for(self, experts: Iterable[int]) -> int:
        """Slots a step needing `experts` can use: capacity minus pins, holds and reads in flight it does not share."""
        # A read still in flight with no hold (its step was released early) keeps its slot too.
        if not self.pinned and not self.held and not self._loading:
            return self.capacity
        blocked = (self.pinned | self.held.keys() | self._loading).difference(experts)
        return self.capacity - len(blocked)

    def all_ready(self, experts: Iterable[int]) -> bool:
        """Every one of `experts` is resident and none is loading: an acquire of them is all hits."""
        slot_of, loading = self.slot_of, self._loading
        return all(e in slot_of and e not in loading for e in experts)

    def ready_slots(self, experts: Iterable[int]) -> list[int] | None:
        """The slot of each of `experts` (repeats allowed) when `all_ready` of them, else None. Reads only."""
        slot_of, loading = self.slot_of, self._loading
        out = []
        for e in experts:
            s = slot_of.get(e)
            if s is None or e in loading:
                return None
            out.append(s)
        return out

    def can_acquire_now(self, experts: Sequence[int]) -> bool:
        """Whether `acquire(experts)` finds a slot for each miss without waiting.

        False when the only slots left are still loading for a step that was cancelled:
        they become evictable when their reads finish.
        """
        need = set(experts)
        missing = len(need.difference(self.slot_of))
        return missing <= len(self._free) or missing <= self._takeable(need)

    def slack(self, experts: Sequence[int]) -> int:
        """Slots an acquire of `experts` could take now beyond one for each miss (negative: it would wait)."""
        need = set(experts)
        return self._takeable(need) - len(need.difference(self.slot_of))

    def _takeable(self, need: set[int]) -> int:
        """Slots free, or READY with an expert neither held, pinned nor in `need`."""
        slot_of = self.slot_of
        kept_of = self.pinned | self.held.keys() | need
        if not self._loading:  # every slot taken is READY
            kept = len([e for e in kept_of if e in slot_of])
        else:
            state = self.state
            kept = sum(1 for e in kept_of if (s := slot_of.get(e)) is not None and state[s] is SlotState.READY)
        return len(self._free) + self._ready - kept

    # ----------------------------------------------------------------- decisions

    def acquire(self, experts: Sequence[int]) -> AcquirePlan:
        """Plan a step's use of `experts` (distinct ids) and hold them until `release`.

        Raises CapacityError (nothing changed) when they cannot all be resident at once.
        """
        if (_c_acquire and _slot_table is not None and type(self.eviction) is LFU
                and (got := _slot_table.acquire(self, experts)) is not None):
            return AcquirePlan(*got)
        if len(experts) > (room := self.available_for(experts)):
            raise CapacityError(
                f"layer {self.layer}: a step needs {len(experts)} distinct experts, "
                f"{room} of {self.capacity} slots are usable (the rest are pinned, held or loading)"
            )
        hits: list[tuple[int, int]] = []
        waiting: list[tuple[int, int]] = []
        missing: list[int] = []
        # One pass, locals bound: replay runs this per layer-step (holds are counted in the same order).
        slot_of, state, held, accessed, tick = self.slot_of, self.state, self.held, self.eviction.accessed, self.tick
        for e in experts:
            held[e] = held.get(e, 0) + 1
            s = slot_of.get(e)
            if s is None:
                missing.append(e)
                continue
            tick += 1
            accessed(e, tick)
            (hits if state[s] is SlotState.READY else waiting).append((e, s))
        self.tick = tick
        evict = len(missing) - len(self._free)
        pick_many = getattr(self.eviction, "pick_many", None) if evict > 1 else None
        if pick_many is None:
            loads = tuple([self._load(e) for e in missing])
        else:  # the victims of the misses past the free slots at once (LFU.pick_many: the same ones, in order)
            chosen = pick_many(evict, self._loading, self.held, self.pinned)
            assert len(chosen) == evict, f"layer {self.layer}: no evictable slot"
            free = len(self._free)
            loads = tuple([self._load(e) for e in missing[:free]]
                          + [self._load(e, v) for e, v in zip(missing[free:], chosen, strict=True)])
        return AcquirePlan(tuple(hits), loads, tuple(waiting))

    def acquire_ready(self, experts: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """`acquire(experts)` when `all_ready(experts)`: its hits (the plan has no load and no wait). No room
        check: the experts and whatever else is pinned, held or loading all have slots already."""
        hits: list[tuple[int, int]] = []
        slot_of, held, accessed, tick = self.slot_of, self.held, self.eviction.accessed, self.tick
        for e in experts:
            held[e] = held.get(e, 0) + 1
            tick += 1
            accessed(e, tick)
            hits.append((e, slot_of[e]))
        self.tick = tick
        return tuple(hits)

    def _evictable(self) -> list[int]:
        """Ready experts no step holds and nothing pins, in `slot_of` order (the victim search's ties)."""
        blocked = self._loading.union(self.held.keys(), self.pinned)
        return [c for c in self.slot_of if c not in blocked]

    def _load(self, expert: int, evicted: int = FREE) -> Load:
        if self._free:
            slot = self._free.pop()
        else:
            if evicted == FREE:
                # acquire() checked room, so an evictable expert exists; none is a table bug.
                found = self.eviction.pick(self._loading, self.held, self.pinned, expert)
                assert found is not None, f"layer {self.layer}: no evictable slot"
                evicted = found
            slot = self.slot_of.pop(evicted)
            self.eviction.removed(evicted)
            self._ready -= 1  # candidates are READY
        cause = LoadCause.CAPACITY if expert in self.seen else LoadCause.COLD
        self.seen.add(expert)
        self.slot_of[expert] = slot
        self.expert_of[slot] = expert
        self.state[slot] = SlotState.LOADING
        self._loading.add(expert)
        self.generation[slot] += 1
        self.tick += 1
        self.eviction.inserted(expert, self.tick)
        return Load(expert, slot, evicted, cause)

    def spare(self, incoming: int, keep: Iterable[int] = ()) -> int | None:
        """A slot to give up for `incoming` without waiting: a free one (the one `_load` takes next), else the
        slot of the eviction policy's victim among the ready experts neither held, pinned nor in `keep`; None
        if neither. (`incoming` is what the victim makes room for: ARC and S3-FIFO choose by it.)"""
        if self._free:
            return self._free[-1]
        held: Collection[int] = self.held.keys() | set(keep) if keep else self.held
        found = self.eviction.pick(self._loading, held, self.pinned, incoming)
        return None if found is None else self.slot_of[found]

    def prefetch(self, expert: int) -> Load | None:
        """Start loading `expert` without holding it (a prefetch), or None: present, or no slot to give.

        Only a free slot or an evictable expert (ready, not held, not pinned) is taken.
        """
        if expert in self.slot_of:
            return None
        evicted = FREE
        if not self._free:
            found = self.eviction.pick(self._loading, self.held, self.pinned, expert)
            if found is None:
                return None
            evicted = found
        return self._load(expert, evicted)

    def cancel_load(self, expert: int, slot: int) -> None:
        """A load that will not happen (an expired prefetch): the slot is free again."""
        if self.slot_of.get(expert) != slot or self.state[slot] is not SlotState.LOADING:
            raise AssertionError(f"layer {self.layer}: cancel of expert {expert} in slot {slot}, not loading there")
        self._drop(expert)

    def clear_unused(self) -> list[int]:
        """Free every ready expert no step holds and nothing pins; returns them (a side region cleared per step)."""
        out = self._evictable()
        for e in out:
            self._drop(e)
        return out

    def _drop(self, expert: int) -> None:
        slot = self.slot_of.pop(expert)
        self.eviction.removed(expert)
        self.expert_of[slot] = FREE
        if self.state[slot] is SlotState.READY:
            self._ready -= 1
        self._loading.discard(expert)
        self.state[slot] = SlotState.FREE
        self._free.append(slot)

    def vacate(self, slot: int) -> int:
        """Take the ready, unheld, unpinned expert out of `slot` (FREE when it is free), leaving the slot free.

        Half of a relabelling (qnpipe.policy.pool): the expert's bytes stay where they are and the
        slot goes to another table; `fill` is the other half."""
        e = self.expert_of[slot]
        if e == FREE:
            self._free.remove(slot)
            return FREE
        if self.state[slot] is not SlotState.READY or e in self.held or e in self.pinned:
            raise AssertionError(f"layer {self.layer}: slot {slot} (expert {e}) is not ready and unused")
        del self.slot_of[e]
        self.eviction.removed(e)
        self._ready -= 1
        self.expert_of[slot] = FREE
        self.state[slot] = SlotState.FREE
        return e

    def fill(self, slot: int, expert: int, generation: int) -> None:
        """Put `expert`, ready (its bytes already in the slot), in the slot `vacate` left; FREE leaves it free."""
        self.generation[slot] = generation
        if expert == FREE:
            self._free.append(slot)
            return
        self.seen.add(expert)
        self.slot_of[expert] = slot
        self.expert_of[slot] = expert
        self.state[slot] = SlotState.READY
        self._ready += 1
        self.tick += 1
        self.eviction.inserted(expert, self.tick)

    def loaded(self, expert: int, slot: int) -> None:
        """The read of `expert` into `slot` completed."""
        if self.slot_of.get(expert) != slot or self.state[slot] is not SlotState.LOADING:
            raise AssertionError(f"layer {self.layer}: read done for expert {expert} in slot {slot}, "
                                 f"which the table does not expect")
        self.state[slot] = SlotState.READY
        self._loading.discard(expert)
        self._ready += 1

    def hold(self, experts: Iterable[int]) -> None:
        """One more hold on each of `experts` (present) without a use: kept in memory, as for an acquire that
        waits (qnpipe.policy.pool.Deferred); `release` drops it."""
        for e in experts:
            if e not in self.slot_of:
                raise AssertionError(f"layer {self.layer}: hold of expert {e}, which is not in the table")
            self.held[e] = self.held.get(e, 0) + 1

    def release(self, experts: Iterable[int]) -> None:
        """Drop one hold on each of `experts` (acquired or held before)."""
        for e in experts:
            n = self.held[e] - 1
            if n:
                self.held[e] = n
            else:
                del self.held[e]

    def pin(self, expert: int) -> None:
        """Keep `expert` resident until `unpin` (it must be resident or loading)."""
        if expert not in self.slot_of:
            raise ValueError(f"layer {self.layer}: cannot pin expert {expert}: not in the pool")
        self.pinned.add(expert)

    def unpin(self, expert: int) -> None:
        self.pinned.discard(expert)

    def forward_done(self) -> None:
        self.eviction.forward_done()

    # ----------------------------------------------------------------- checks

    def verify(self, token_experts: Sequence[int], token_slots: Sequence[int],
               generations: dict[int, int]) -> str | None:
        """Route verification: each slot read holds the routed expert, unchanged since the grant.

        Returns a description of the first violation, or None.
        """
        for e, s in zip(token_experts, token_slots, strict=True):
            if not 0 <= s < self.capacity or self.expert_of[s] != e or self.state[s] is not SlotState.READY:
                held = self.expert_of[s] if 0 <= s < self.capacity else "nothing"
                return f"layer {self.layer}: a token routed to expert {e} read slot {s}, which holds {held}"
            if generations.get(s) != self.generation[s]:
                return (f"layer {self.layer}: slot {s} (expert {e}) was rewritten while a step read it "
                        f"(generation {generations.get(s)} at grant, {self.generation[s]} now)")
        return None


if _slot_table is not None:
    _slot_table.init(SlotState.READY, SlotState.LOADING, Load, LoadCause.COLD, LoadCause.CAPACITY, TICK_BITS)
