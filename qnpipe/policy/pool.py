"""The pool's decisions over every layer: grants, the reads they need, and the counters.

`PoolPolicy` is what the pool actor (qnpipe.actors.pool) drives: `acquire` plans a
grant and names the reads to issue; `read_done` says which grants became complete;
`release` ends a grant (and checks the route when asked). It never waits and never
touches a clock: times come in as arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from qnpipe.errors import CapacityError, RouteError
from qnpipe.policy.eviction import LFU, Eviction
from qnpipe.policy.heat import Heat
from qnpipe.policy.slot_table import FREE, AcquirePlan, Load, MissCause, SlotState, SlotTable

GrantKey = tuple[int, int, int]  # (step, layer, part)


class MissKind(enum.StrEnum):
    """The one cause of a miss (an expert a step needed that was not ready in memory).

    Without prediction a miss is `cold` or `capacity`; with it, a non-cold miss is
    `late` (predicted, its read still queued or in flight, or expired), `dropped`
    (predicted, not read for a budget or no side slot), `evicted` (prefetched, evicted
    before use) or `not_predicted`.
    """

    COLD = "cold"
    CAPACITY = "capacity"
    NOT_PREDICTED = "not_predicted"
    LATE = "late"
    DROPPED = "dropped"
    EVICTED = "evicted"


class HintFate(enum.IntEnum):
    ISSUED = 0
    DROPPED = 1
    EVICTED = 2
    EXPIRED = 3


@attrs.frozen(slots=True)
class PrefetchBudgets:
    """Caps on speculation (0 or None = no cap where noted)."""

    per_layer: int = 4  # prefetches issued per (step, target layer)
    global_reads: int = 64  # prefetch reads issued and not finished, all layers
    # prefetches issued during the current forward step and not used yet, all layers; older
    # unused ones are just cached side-region entries and do not count (they would fill it for good)
    global_unused: int = 64
    per_hint: int | None = None  # read.prefetch_budget_experts
    window_layers: int = 0  # targets more than this many MoE layers ahead are dropped (0 = no limit)


@attrs.frozen
class PoolOptions:
    """What a pool does beyond demand caching, fixed when it is built (`PoolPolicy.build`).

    `side_slots` per layer of side region where prefetches land (kept by LFU when
    `side_persistent`, else cleared at each step's end); with `into_main` prefetches land in the
    resident region instead and the side region keeps what they displaced (docs/pool.md,
    "Prefetch placement"); `recall_prof` keeps per-acquire recall samples (diag.predict_recall_prof)."""

    predicting: bool = False
    side_slots: int = 0
    into_main: bool = False
    side_persistent: bool = True
    budgets: PrefetchBudgets = PrefetchBudgets()
    recall_prof: bool = False


@attrs.define(slots=True)
class SlotMap:
    """One layer's slots as one stacked array (the resident slots, then the side region's) and which
    region each serves now: with prefetch_into=main an expert moves between regions by relabelling
    its slot, never by a copy. `main[r]` / `side[s]`: the physical slot of each table's slot;
    `at[p]`: (in the side region, the table's slot) of physical slot `p`."""

    main: list[int]
    side: list[int]
    at: list[tuple[bool, int]]

    @classmethod
    def identity(cls, capacity: int, side: int) -> SlotMap:
        return cls(list(range(capacity)), list(range(capacity, capacity + side)),
                   [(False, r) for r in range(capacity)] + [(True, s) for s in range(side)])

    def swap(self, r: int, s: int) -> None:
        """Resident slot `r` and side slot `s` trade their physical slots."""
        self.main[r], self.side[s] = self.side[s], self.main[r]
        self.at[self.main[r]] = (False, r)
        self.at[self.side[s]] = (True, s)


@attrs.frozen(slots=True)
class Deferred:
    """An acquire accepted but waiting for slots still loading (`PoolPolicy.deferred`). Its experts keep their
    room from acquires made later; `side` are those it found in the side region, held there while it waits so
    that they stay in memory (leaving, they would need resident slots it was not accepted with)."""

    experts: tuple[int, ...]
    asked: float
    side: tuple[int, ...]


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
    side: frozenset[int] = frozenset()  # experts served from the side region


@attrs.define(slots=True)
class LayerCounters:
    hits: int = 0
    side_hits: int = 0
    misses: int = 0
    cold: int = 0
    capacity: int = 0
    evictions: int = 0
    causes: dict[MissKind, int] = attrs.field(factory=dict)
    used: int = 0  # experts acquired (recall denominator)
    predicted_used: int = 0  # ... of them among the predictor's candidates since the layer's last acquire
    prefetch_reads: int = 0  # side-region reads finished
    prefetch_used: int = 0  # prefetches a step used (once each; late ones included)


@attrs.frozen
class PoolStatistics:
    """A frozen snapshot of the pool policy's figures (`PoolPolicy.statistics()`), summed over layers.

    The one place the per-layer counters are added up: the engine's stats and the replay
    report are both made from it. `layers` holds copies, detached from the live counters.
    """

    layers: dict[int, LayerCounters]
    hits: int
    misses: int
    side_hits: int
    used: int
    predicted_used: int
    prefetch_reads: int
    prefetch_used: int
    causes: dict[str, int]  # str(MissKind) -> misses of that cause
    prefetches_issued: int
    prefetches_done: int
    prefetches_used: int
    prefetches_expired: int
    hints_dropped_budget: int
    wasted_bytes: int

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def recall(self) -> float:
        return self.predicted_used / self.used if self.used else 0.0


@attrs.define
class PoolPolicy:
    """Slot tables of every MoE layer and the grants in progress."""

    tables: dict[int, SlotTable]
    record_nbytes: Mapping[int, int]
    pending: dict[GrantKey, Grant] = attrs.field(factory=dict)
    held: dict[GrantKey, Grant] = attrs.field(factory=dict)
    waiters: dict[tuple[int, int], list[GrantKey]] = attrs.field(factory=dict)
    deferred: dict[GrantKey, Deferred] = attrs.field(factory=dict)  # in the order they were accepted
    counters: dict[int, LayerCounters] = attrs.field(init=False)
    reads: int = 0
    bytes_read: int = 0
    # -- side region and prefetch (empty when the pool has no side region)
    sides: dict[int, SlotTable] = attrs.field(factory=dict)
    side_persistent: bool = True
    predicting: bool = False
    budgets: PrefetchBudgets = attrs.field(factory=PrefetchBudgets)
    moe_order: dict[int, int] = attrs.field(factory=dict)  # layer -> its index among MoE layers
    promotions: list[tuple[int, int, int]] = attrs.field(factory=list)  # (layer, expert, slot) now demanded
    landed: list[tuple[GrantKey, int, int]] = attrs.field(factory=list)  # (key, expert, slot): read, grant not complete
    fates: dict[int, dict[int, HintFate]] = attrs.field(factory=dict)  # since the layer's last acquire
    hinted: dict[int, set[int]] = attrs.field(factory=dict)
    unused: dict[tuple[int, int], bool] = attrs.field(factory=dict)  # prefetched, not used yet
    step_unused: set[tuple[int, int]] = attrs.field(factory=set)  # ... of them issued in the current step
    issued_per_step: dict[tuple[int, int], int] = attrs.field(factory=dict)
    used_before: dict[int, set[int]] = attrs.field(factory=dict)
    prefetch_reads_out: int = 0
    prefetches_issued: int = 0
    prefetches_done: int = 0
    prefetches_used: int = 0
    prefetches_expired: int = 0
    hints_dropped_budget: int = 0
    wasted_bytes: int = 0
    recall_samples: list[tuple[int, int, int]] | None = None  # diag.predict_recall_prof: (layer, used, predicted)
    into_main: bool = False  # pool.prefetch_into=main: prefetches land in the resident region
    slot_maps: dict[int, SlotMap] = attrs.field(factory=dict)  # layers whose regions trade slots (into_main)
    prefetching: set[tuple[int, int]] = attrs.field(factory=set)  # into_main: prefetch reads not done yet
    heat: Heat | None = None  # autopin: routing heat, counted at each demand acquire (qnpipe.policy.heat)

    def __attrs_post_init__(self) -> None:
        self.counters = {layer: LayerCounters() for layer in self.tables}
        self.moe_order = self.moe_order or {layer: i for i, layer in enumerate(sorted(self.tables))}

    def statistics(self) -> PoolStatistics:
        layers = {layer: attrs.evolve(c, causes=dict(c.causes)) for layer, c in self.counters.items()}
        cs = layers.values()
        causes: dict[str, int] = {}
        for c in cs:
            for kind, n in c.causes.items():
                causes[str(kind)] = causes.get(str(kind), 0) + n
        return PoolStatistics(
            layers=layers, hits=sum(c.hits for c in cs), misses=sum(c.misses for c in cs),
            side_hits=sum(c.side_hits for c in cs), used=sum(c.used for c in cs),
            predicted_used=sum(c.predicted_used for c in cs), prefetch_reads=sum(c.prefetch_reads for c in cs),
            prefetch_used=sum(c.prefetch_used for c in cs), causes=causes, prefetches_issued=self.prefetches_issued,
            prefetches_done=self.prefetches_done, prefetches_used=self.prefetches_used,
            prefetches_expired=self.prefetches_expired, hints_dropped_budget=self.hints_dropped_budget,
            wasted_bytes=self.wasted_bytes)

    def _table_of(self, layer: int, slot: int) -> tuple[SlotTable, int]:
        main = self.tables[layer]
        if (m := self.slot_maps.get(layer)) is not None:
            in_side, local = m.at[slot]
            return (self.sides[layer] if in_side else main), local
        if slot >= main.capacity:
            return self.sides[layer], slot - main.capacity
        return main, slot

    @classmethod
    def build(cls, capacities: Mapping[int, int], evictions: Mapping[int, Eviction],
              record_nbytes: Mapping[int, int], options: PoolOptions = PoolOptions(),
              heat: Heat | None = None) -> PoolPolicy:
        """The policy of these slot tables with `options` (and autopin's `heat`, counted at each acquire)."""
        tables = {layer: SlotTable(layer, cap, evictions[layer]) for layer, cap in capacities.items()}
        sides = ({layer: SlotTable(layer, options.side_slots, LFU()) for layer in capacities}
                 if options.side_slots > 0 else {})
        maps = ({layer: SlotMap.identity(cap, options.side_slots) for layer, cap in capacities.items()}
                if options.into_main and sides else {})
        return cls(tables, record_nbytes, sides=sides, side_persistent=options.side_persistent,
                   predicting=options.predicting, budgets=options.budgets,
                   recall_samples=[] if options.recall_prof else None, heat=heat, into_main=options.into_main,
                   slot_maps=maps)

    def preload(self, layer: int, experts: Sequence[int]) -> list[Load]:
        """Put `experts` (distinct) in `layer`'s pool, pinned; returns the reads to issue.

        The table's acquire gives each a slot (no step holds them: released at once) and the
        pin keeps them there. The loads count as cold misses' loads in the layer's counters
        (cold + capacity = loads = reads) but not as misses: hits and misses are demand only.
        Raises CapacityError when they cannot all be in the pool.
        """
        table = self.tables[layer]
        plan = table.acquire(experts)
        table.release(experts)
        for e in experts:
            table.pin(e)
        c = self.counters[layer]
        c.cold += sum(ld.cause is MissCause.COLD for ld in plan.loads)
        c.capacity += sum(ld.cause is MissCause.CAPACITY for ld in plan.loads)
        c.evictions += sum(ld.evicted >= 0 for ld in plan.loads)
        return list(plan.loads)

    def acquire(self, key: GrantKey, experts: Sequence[int], now: float) -> tuple[list[Load], Grant | None]:
        """Plan the grant `key` of `experts`; returns the reads to issue and the grant if complete.

        When the slots it needs are still loading for a cancelled step, the acquire waits
        (no reads, no grant) and `read_done` takes it up again.
        """
        if key in self.pending or key in self.held or key in self.deferred:
            raise AssertionError(f"grant {key} asked for twice")
        if self.heat is not None:
            self.heat.count(key[0], key[1], experts)
        out = self._admit(key, experts, now)
        if out is None:
            self._defer(key, experts, now)
            return [], None
        return out

    def _split(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[int]]:
        """(in the side region, the rest) of `experts`."""
        side = self.sides.get(layer)
        if side is not None and any(e in side.slot_of for e in experts):
            return [e for e in experts if e in side.slot_of], [e for e in experts if e not in side.slot_of]
        return [], list(experts)

    def _defer(self, key: GrantKey, experts: Sequence[int], now: float) -> None:
        in_side, _ = self._split(key[1], experts)
        if in_side:
            self.sides[key[1]].hold(in_side)
        self.deferred[key] = Deferred(tuple(experts), now, tuple(in_side))

    def _admit(self, key: GrantKey, experts: Sequence[int], now: float) -> tuple[list[Load], Grant | None] | None:
        """Grant `key` now if its resident part has a slot for each miss: the reads to issue and the grant if
        complete; None: it must wait for slots still loading. CapacityError (nothing changed) when the
        resident region cannot give its part even once the reads are done."""
        layer = key[1]
        side = self.sides.get(layer)
        table = self.tables[layer]
        in_side, main_part = self._split(layer, experts)
        # Acquires deferred before this one keep their room: one made later must not take it, or they could
        # wait forever once the reads are done. One deferred itself counts only those before it, as when it
        # was accepted (after it, each was checked against its room).
        reserved = self.reserved(layer, before=key) if self.deferred else set()
        if len(main_part) > (room := table.room_ever(main_part, reserved)):
            raise CapacityError(
                f"layer {layer}: a step needs {len(main_part)} distinct experts, {room} of "
                f"{table.capacity} slots are usable (the rest are pinned, held or kept for waiting acquires)"
            )
        if not table.can_acquire_now(main_part):
            return None
        promoted: list[int] = []
        if self.into_main and in_side:
            promoted = self._promote(layer, experts, main_part, reserved)
            if promoted:
                in_side, main_part = self._split(layer, experts)
        plan = table.acquire(main_part)
        # the side region's part is held before a demand load's victim moves there and takes a side slot
        splan = side.acquire(in_side) if in_side and side is not None else None
        slot_of = dict(plan.hits) | dict(plan.waiting) | {ld.expert: ld.slot for ld in plan.loads}
        gen_of = {e: table.generation[s] for e, s in slot_of.items()}
        hits = len(plan.hits)
        missing = {e for e, _ in plan.waiting} | {ld.expert for ld in plan.loads}
        late: set[int] = set()
        loads = list(plan.loads)
        if self.into_main:
            loads, late = self._main_plan(layer, plan, slot_of, gen_of, promoted)
        m = self.slot_maps.get(layer)
        if splan is not None:
            assert side is not None and not splan.loads  # all present: hits or loading, never a load
            for e, s in (*splan.hits, *splan.waiting):
                slot_of[e] = table.capacity + s if m is None else m.side[s]
                gen_of[e] = side.generation[s]
            hits += len(splan.hits)
            self.counters[layer].side_hits += len(splan.hits)
            for e, _ in splan.waiting:  # a prefetch still on its way: the step now waits for it
                missing.add(e)
                self.promotions.append((layer, e, slot_of[e]))
        slots = [slot_of[e] for e in experts]
        c = self.counters[layer]
        c.hits += hits
        c.misses += len(missing)
        for ld in plan.loads:
            if ld.cause is MissCause.COLD:
                c.cold += 1
            else:
                c.capacity += 1
            c.evictions += ld.evicted >= 0
        self._attribute(layer, experts, missing, side, late)
        grant = Grant(key, tuple(experts), slots, [gen_of[e] for e in experts], missing, hits, len(missing),
                      now, frozenset(in_side))
        for e in grant.missing:
            self.waiters.setdefault((key[1], e), []).append(key)
        if grant.missing:
            self.pending[key] = grant
            return loads, None
        self.held[key] = grant
        return loads, grant

    # ----------------------------------------------------------------- prefetch_into=main

    def _promote(self, layer: int, experts: Sequence[int], main_part: list[int], reserved: set[int]) -> list[int]:
        """Move the ready side-region experts of this acquire into the resident region, each by trading
        its slot with a free resident slot or the eviction policy's victim (which moves to the side
        region, still in memory); those with no resident slot to take stay where they are.

        A slot goes to a promotion only when the resident part (`main_part`, `reserved` kept for the
        acquires before) still fits and keeps a slot for each of its misses: a promotion must never turn
        an acquire that can be granted now into one that waits or is refused."""
        main, side = self.tables[layer], self.sides[layer]
        out: list[int] = []
        free = main.slack(main_part)
        for e in experts:
            s = side.slot_of.get(e)
            if s is None or side.state[s] is not SlotState.READY or e in side.held or e in side.pinned:
                continue
            need = [*main_part, *out, e]
            if free < 1 or len(need) > main.room_ever(need, reserved):
                break
            r = main.spare(e, experts)
            if r is None:
                break
            self._relabel(layer, r, s)
            out.append(e)
            free -= 1
        return out

    def _relabel(self, layer: int, r: int, s: int) -> None:
        """Resident slot `r` and side slot `s` trade their experts by trading physical slots: no bytes move."""
        main, side = self.tables[layer], self.sides[layer]
        gen_r, gen_s = main.generation[r], side.generation[s]
        v, x = main.vacate(r), side.vacate(s)
        main.fill(r, x, gen_s)
        side.fill(s, v, gen_r)
        self.slot_maps[layer].swap(r, s)

    def _main_plan(self, layer: int, plan: AcquirePlan, slot_of: dict[int, int], gen_of: dict[int, int],
                   promoted: list[int]) -> tuple[list[Load], set[int]]:
        """prefetch_into=main's part of an acquire: what each demand load evicts moves to the side region
        (as a prefetch's victim does), slots made physical, the hits a prefetch made (counted as side
        hits) and the prefetches the step now waits for (late: read as demand). Returns the loads
        (physical slots) and the late experts."""
        m = self.slot_maps.get(layer)
        main = self.tables[layer]
        loads: list[Load] = []
        for ld in plan.loads:
            evicted = ld.evicted
            if m is not None and evicted >= 0 and (s := self.sides[layer].spare(evicted)) is not None:
                # The load goes to side slot s's physical slot (its expert, if any, leaves memory) and the
                # evicted expert stays in its own, now a side slot: the two slots trade regions.
                side = self.sides[layer]
                gen_r, gen_s = main.generation[ld.slot] - 1, side.generation[s]  # `_load` bumped r's
                dropped = side.vacate(s)
                m.swap(ld.slot, s)
                side.fill(s, evicted, gen_r)
                main.generation[ld.slot] = gen_of[ld.expert] = gen_s + 1
                evicted = dropped
            if evicted >= 0:
                self._wasted(layer, evicted)
            loads.append(ld if m is None else Load(ld.expert, m.main[ld.slot], evicted, ld.cause))
        if m is not None:
            for e, s in slot_of.items():
                slot_of[e] = m.main[s]
        prefetched = {e for e, _ in plan.hits if (layer, e) in self.unused}
        self.counters[layer].side_hits += len(prefetched.union(promoted))
        late = {e for e, _ in plan.waiting if (layer, e) in self.prefetching}
        for e in sorted(late):
            self.promotions.append((layer, e, slot_of[e]))
        return loads, late

    def _place(self, layer: int, expert: int) -> Load | None:
        """prefetch_into=main: a slot for a prefetch of `expert` (a Load with its physical slot), or None.

        A free resident slot, else the resident eviction policy's victim, which moves to the side
        region by relabelling when the side region has a slot to give (free, or its LFU victim, which
        leaves memory), else leaves memory. With no resident slot to give, the side region takes the
        prefetch as with prefetch_into=side."""
        main, side = self.tables[layer], self.sides.get(layer)
        m = self.slot_maps.get(layer)
        if side is None or m is None:
            return main.prefetch(expert)
        r = main.spare(expert)
        if r is None:
            ld = side.prefetch(expert)
            return None if ld is None else Load(expert, m.side[ld.slot], ld.evicted, ld.cause)
        dropped = FREE
        if main.expert_of[r] != FREE and (s := side.spare(main.expert_of[r])) is not None:
            dropped = side.vacate(s)  # the side region's victim leaves memory (or the slot was free)
            side.fill(s, FREE, side.generation[s])
            self._relabel(layer, r, s)
        ld = main.prefetch(expert)
        assert ld is not None, f"layer {layer}: slot {r} was spare"
        return Load(expert, m.main[ld.slot], dropped if dropped != FREE else ld.evicted, ld.cause)

    def present(self, key: GrantKey) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(experts, slots) of grant `key` already in memory while the rest is read; () when the
        grant is complete, deferred or has nothing in memory yet. The grant holds them already."""
        g = self.pending.get(key)
        if g is None:
            return (), ()
        pairs = [(e, s) for e, s in zip(g.experts, g.slots, strict=True) if e not in g.missing]
        return tuple(e for e, _ in pairs), tuple(s for _, s in pairs)

    def _attribute(self, layer: int, experts: Sequence[int], missing: set[int], side: SlotTable | None,
                   late: set[int]) -> None:
        """Give every miss of this acquire exactly one cause; count recall and used prefetches."""
        c = self.counters[layer]
        seen = self.used_before.setdefault(layer, set())
        fates = self.fates.pop(layer, {})
        hinted = self.hinted.pop(layer, set())
        c.used += len(experts)
        predicted = sum(e in hinted for e in experts)
        c.predicted_used += predicted
        if self.recall_samples is not None and self.predicting:
            self.recall_samples.append((layer, len(experts), predicted))
        for e in experts:
            self.step_unused.discard((layer, e))
            if self.unused.pop((layer, e), None) is not None:
                self.prefetches_used += 1
                c.prefetch_used += 1
            if e not in missing:
                continue
            fate = fates.get(e)
            if (side is not None and e in side.slot_of) or e in late:  # its prefetch is on the way: used, late
                kind = MissKind.LATE
                self.prefetches_used += 1
                c.prefetch_used += 1
            elif fate is HintFate.EXPIRED:
                kind = MissKind.LATE
            elif fate is HintFate.DROPPED:
                kind = MissKind.DROPPED
            elif fate is HintFate.EVICTED:
                kind = MissKind.EVICTED
            elif e not in seen:
                kind = MissKind.COLD
            else:
                kind = MissKind.NOT_PREDICTED if self.predicting else MissKind.CAPACITY
            c.causes[kind] = c.causes.get(kind, 0) + 1
        seen.update(experts)

    def pop_landed(self) -> list[tuple[GrantKey, int, int]]:
        """(key, expert, slot) of reads that finished for grants still waiting on others, since the last call:
        what an early grant's step may start on (the grant holds them already)."""
        out, self.landed = self.landed, []
        return out

    def pop_promotions(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) of prefetches a step now waits for: to be read as demand reads."""
        out, self.promotions = self.promotions, []
        return out

    # ----------------------------------------------------------------- prefetch

    def prefetch(self, step: int, source: int, layer: int, ranked: Sequence[tuple[int, float]]) -> list[Load]:
        """Plan the prefetch of `ranked` candidates (best first) for `layer`, hinted at MoE layer `source`.

        Returns the side-region loads to issue; experts already in memory or on their way
        are skipped, and those over a budget (or with no side slot to take) are dropped.
        """
        side = self.sides.get(layer)
        main = self.tables[layer]
        self.hinted.setdefault(layer, set()).update(e for e, _ in ranked)
        if side is None and not self.into_main:
            return []
        fates = self.fates.setdefault(layer, {})
        b = self.budgets
        ahead = self.moe_order[layer] - self.moe_order.get(source, -1)
        loads: list[Load] = []
        key = (step, layer)
        for e, _ in ranked:
            if e in main.slot_of or (side is not None and e in side.slot_of):
                continue
            over = ((b.window_layers and ahead > b.window_layers)
                    or self.issued_per_step.get(key, 0) >= b.per_layer
                    or self.prefetch_reads_out >= b.global_reads
                    or len(self.step_unused) >= b.global_unused
                    or (b.per_hint is not None and len(loads) >= b.per_hint))
            if over:
                ld = None
            elif self.into_main:
                ld = self._place(layer, e)
            else:
                assert side is not None
                ld = side.prefetch(e)
            if ld is None:
                fates[e] = HintFate.DROPPED
                self.hints_dropped_budget += 1
                continue
            if ld.evicted >= 0:
                self._wasted(layer, ld.evicted)
            fates[e] = HintFate.ISSUED
            self.step_unused.add((layer, e))
            self.issued_per_step[key] = self.issued_per_step.get(key, 0) + 1
            self.prefetch_reads_out += 1
            self.prefetches_issued += 1
            if self.into_main:
                self.prefetching.add((layer, e))
                loads.append(ld)
            else:
                loads.append(Load(e, main.capacity + ld.slot, ld.evicted, ld.cause))
        return loads

    def _wasted(self, layer: int, expert: int) -> None:
        self.step_unused.discard((layer, expert))
        if self.unused.pop((layer, expert), None) is not None:
            self.wasted_bytes += self.record_nbytes[layer]
            self.fates.setdefault(layer, {})[expert] = HintFate.EVICTED

    def read_expired(self, layer: int, expert: int, slot: int) -> bool:
        """A prefetch's deadline passed before it started. True: a step waits for it, read it as demand."""
        self.prefetch_reads_out -= 1
        self.prefetches_expired += 1
        table, local = self._table_of(layer, slot)
        if (layer, expert) in self.waiters or expert in table.held:  # held: a deferred acquire counts on it
            self.prefetch_reads_out += 1  # it goes out again, now as a demand read
            return True
        table.cancel_load(expert, local)
        self.prefetching.discard((layer, expert))
        self.step_unused.discard((layer, expert))
        self.fates.setdefault(layer, {})[expert] = HintFate.EXPIRED
        return False

    def reserved(self, layer: int, before: GrantKey | None = None) -> set[int]:
        """Experts of the acquires deferred at `layer` (those deferred before `before`, when it is one)."""
        out: set[int] = set()
        for k, d in self.deferred.items():
            if k == before:
                break
            if k[1] == layer:
                out.update(d.experts)
        return out

    def read_done(self, layer: int, expert: int, slot: int) -> tuple[list[Load], list[Grant]]:
        """The read of (`layer`, `expert`) into `slot` finished: the reads and grants that follows."""
        done = self._read_done(layer, expert, slot)
        loads, more = self.retry_deferred(layer)
        return loads, done + more

    def retry_deferred(self, layer: int) -> tuple[list[Load], list[Grant]]:
        """Take up the acquires deferred at `layer` that a slot now lets through: their reads and complete grants."""
        loads: list[Load] = []
        done: list[Grant] = []
        for key, d in list(self.deferred.items()):
            if key[1] != layer:
                continue
            if d.side:  # its own holds: the side region's part may move to the resident region now
                self.sides[layer].release(d.side)
            try:
                out = self._admit(key, d.experts, d.asked)
            except CapacityError:  # accepted once, never refused: the room it was accepted with comes back
                out = None
            if out is None:  # still waiting, in its place
                in_side, _ = self._split(layer, d.experts)
                if in_side:
                    self.sides[layer].hold(in_side)
                self.deferred[key] = attrs.evolve(d, side=tuple(in_side))
                continue
            del self.deferred[key]
            more, g = out
            loads += more
            if g is not None:
                done.append(g)
        return loads, done

    def _read_done(self, layer: int, expert: int, slot: int) -> list[Grant]:
        table, local = self._table_of(layer, slot)
        table.loaded(expert, local)
        self.reads += 1
        self.bytes_read += self.record_nbytes[layer]
        if ((layer, expert) in self.prefetching) if self.into_main else table is not self.tables[layer]:
            self.prefetching.discard((layer, expert))
            self.prefetch_reads_out -= 1
            self.prefetches_done += 1
            self.counters[layer].prefetch_reads += 1
            if (layer, expert) not in self.waiters:
                self.unused[(layer, expert)] = True
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
            else:
                self.landed.append((key, expert, g.slots[g.experts.index(expert)]))
        return done

    def release(self, key: GrantKey, token_experts: Sequence[int] = (), token_slots: Sequence[int] = ()) -> None:
        """End grant `key` (complete, or still pending when its step was cancelled).

        With `token_experts` / `token_slots`, first check that every pair is what the grant
        gave and the table still holds (route verification); RouteError if not.
        """
        if (d := self.deferred.pop(key, None)) is not None:
            if d.side:
                self.sides[key[1]].release(d.side)
            return
        g = self.held.pop(key, None) or self.pending.pop(key, None)
        if g is None:
            raise AssertionError(f"release of unknown grant {key}")
        table = self.tables[key[1]]
        if token_experts and key[1] in self.slot_maps:
            self._verify_mapped(key, g, token_experts, token_slots)
        elif token_experts:
            gens = dict(zip(g.slots, g.generations, strict=True))
            cap = table.capacity
            pairs = list(zip(token_experts, token_slots, strict=True))
            for t, sel, off in ((table, [p for p in pairs if p[1] < cap], 0),
                                (self.sides.get(key[1]), [p for p in pairs if p[1] >= cap], cap)):
                if not sel:
                    continue
                if t is None:
                    raise RouteError(f"route verification failed at step {key[0]}: layer {key[1]} has no side "
                                     f"region, yet a token read slot {sel[0][1]}")
                err = t.verify([e for e, _ in sel], [s - off for _, s in sel],
                               {s - off: gen for s, gen in gens.items() if (s >= cap) == (off > 0)})
                if err is not None:
                    raise RouteError(f"route verification failed at step {key[0]}: {err}")
        table.release([e for e in g.experts if e not in g.side])
        if g.side:
            self.sides[key[1]].release(g.side)

    def _verify_mapped(self, key: GrantKey, g: Grant, token_experts: Sequence[int],
                       token_slots: Sequence[int]) -> None:
        """Route verification when the regions trade slots: each physical slot checked in the table it is in now."""
        layer = key[1]
        gens = dict(zip(g.slots, g.generations, strict=True))
        n = len(self.slot_maps[layer].at)
        by: dict[int, tuple[SlotTable, list[int], list[int], dict[int, int]]] = {}
        for e, p in zip(token_experts, token_slots, strict=True):
            if not 0 <= p < n:
                raise RouteError(f"route verification failed at step {key[0]}: layer {layer}: a token routed to "
                                 f"expert {e} read slot {p}, which does not exist")
            t, local = self._table_of(layer, p)
            _, es, ss, gs = by.setdefault(id(t), (t, [], [], {}))
            es.append(e)
            ss.append(local)
            if p in gens:
                gs[local] = gens[p]
        for t, es, ss, gs in by.values():
            if (err := t.verify(es, ss, gs)) is not None:
                raise RouteError(f"route verification failed at step {key[0]}: {err}")

    def forward_done(self) -> None:
        if self.heat is not None:
            self.heat.forward_done()
        for t in self.tables.values():
            t.forward_done()
        self.issued_per_step.clear()
        self.step_unused.clear()
        for layer, side in self.sides.items():
            side.forward_done()
            if not self.side_persistent:  # the side region holds one step's speculation only
                for e in side.clear_unused():
                    self._wasted(layer, e)
