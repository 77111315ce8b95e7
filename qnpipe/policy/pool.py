"""The pool's decisions over every layer: grants, the reads they need, and the counters.

`PoolPolicy` is what the pool's core (qnpipe.policy.pool_core) drives: `acquire` plans a
grant and names the reads to issue; `read_done` says which grants became complete;
`release` ends a grant (and checks the route when asked). Each answers with all that
follows from it (an `AcquireResult`, a `ReadResult`): nothing is left behind to collect.
It never waits and never touches a clock: times come in as arguments.

It composes the parts, each in its own module: the grants in progress and the deferred
acquires (`pool_grants.Grants`), where prefetches land and how the regions share a layer's
slots (`placement.SidePlacement` / `MainPlacement`), the prefetch budgets
(`pool_budget.PrefetchGate`), the cause of each miss (`pool_attribution.Attribution`) and
the counters (`pool_counters.PoolCounters`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import msgspec

from qnpipe.errors import CapacityError
from qnpipe.policy.eviction import LFU, Eviction
from qnpipe.policy.heat import Heat
from qnpipe.policy.placement import MainPlacement, Placement, SidePlacement, SlotMap
from qnpipe.policy.pool_attribution import Attribution, HintFate, RecallRecord
from qnpipe.policy.pool_budget import PrefetchBudgets, PrefetchGate
from qnpipe.policy.pool_counters import LayerCounters, MissKind, PoolCounters, PoolStatistics
from qnpipe.policy.pool_grants import Deferred, Grant, GrantKey, Grants, Landed
from qnpipe.policy.slot_table import AcquirePlan, Load, SlotTable

Promotion = tuple[int, int, int]  # (layer, expert, slot): a prefetch a step now waits for, to be read as demand


class AcquireResult(msgspec.Struct, frozen=True):
    """What an acquire leads to: the reads to issue, the grant when complete (None: its reads are on the
    way, or it is deferred), the prefetches the step now waits for, and the recall samples kept since
    the last acquire (diag.predict_recall_prof; those of deferred acquires taken up since included).

    The results are frozen msgspec Structs, made in C (a named tuple's `__new__` is Python, a frozen
    attrs class slower still): one is made per acquire and per read, on the replay's hot path."""

    loads: tuple[Load, ...] = ()
    ready: Grant | None = None
    promotions: tuple[Promotion, ...] = ()
    recall: tuple[RecallRecord, ...] = ()


class ReadResult(msgspec.Struct, frozen=True):
    """What a finished read (or a slot given back) leads to: the reads to issue for the deferred acquires
    it let through, the grants now complete, (key, expert, slot) of reads landed for grants still waiting
    on others (what an early grant's step may start on; the grant holds them already), and the
    prefetches a step now waits for."""

    loads: tuple[Load, ...] = ()
    grants: tuple[Grant, ...] = ()
    landed: tuple[Landed, ...] = ()
    promotions: tuple[Promotion, ...] = ()


NOTHING_READ = ReadResult()  # the answer of a read that leads to nothing (one object: compare with `is`)


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


@attrs.define
class PoolPolicy:
    """Slot tables of every MoE layer (`tables`, and `sides` for the side region) and the parts that decide over them."""

    tables: dict[int, SlotTable]
    sides: dict[int, SlotTable]  # empty when the pool has no side region
    placement: Placement
    grants: Grants
    gate: PrefetchGate
    attribution: Attribution
    tally: PoolCounters
    side_persistent: bool = True
    heat: Heat | None = None  # autopin: routing heat, counted at each demand acquire (qnpipe.policy.heat)

    @classmethod
    def build(cls, capacities: Mapping[int, int], evictions: Mapping[int, Eviction],
              record_nbytes: Mapping[int, int], options: PoolOptions = PoolOptions(),
              heat: Heat | None = None) -> PoolPolicy:
        """The policy of these slot tables with `options` (and autopin's `heat`, counted at each acquire)."""
        tables = {layer: SlotTable(layer, cap, evictions[layer]) for layer, cap in capacities.items()}
        sides = ({layer: SlotTable(layer, options.side_slots, LFU()) for layer in capacities}
                 if options.side_slots > 0 else {})
        tally = PoolCounters.of(tables, record_nbytes)
        attribution = Attribution(tally, options.predicting, [] if options.recall_prof else None)
        placement: Placement = (MainPlacement.of(tables, sides, capacities, options.side_slots, attribution)
                                if options.into_main else SidePlacement(tables, sides))
        gate = PrefetchGate(options.budgets, {layer: i for i, layer in enumerate(sorted(tables))})
        return cls(tables, sides, placement, Grants(), gate, attribution, tally, options.side_persistent, heat)

    # -- the parts' state under the names the drivers, the engine and the tests read
    @property
    def pending(self) -> dict[GrantKey, Grant]:
        return self.grants.pending

    @property
    def held(self) -> dict[GrantKey, Grant]:
        return self.grants.held

    @property
    def deferred(self) -> dict[GrantKey, Deferred]:
        return self.grants.deferred

    @property
    def counters(self) -> dict[int, LayerCounters]:
        return self.tally.layers

    @property
    def moe_order(self) -> dict[int, int]:
        return self.gate.moe_order

    @property
    def prefetch_reads_out(self) -> int:
        return self.gate.reads_out

    @property
    def predicting(self) -> bool:
        return self.attribution.predicting

    @property
    def into_main(self) -> bool:
        """pool.prefetch_into=main: a prefetch read given up frees a resident slot a deferred acquire may take."""
        return isinstance(self.placement, MainPlacement)

    @property
    def slot_maps(self) -> dict[int, SlotMap]:
        """The layers whose regions trade slots (prefetch_into=main with a side region)."""
        return self.placement.maps if isinstance(self.placement, MainPlacement) else {}

    def statistics(self) -> PoolStatistics:
        return self.tally.statistics()

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
        self.tally.loads(layer, plan.loads)
        return list(plan.loads)

    def acquire(self, key: GrantKey, experts: Sequence[int], now: float,
                reads_now: Callable[[Sequence[Load]], None] | None = None) -> AcquireResult:
        """Plan the grant `key` of `experts`: the reads to issue and the grant if complete.

        When the slots it needs are still loading for a cancelled step, the acquire waits (no reads, no grant)
        and `read_done` takes it up again. `reads_now` gets the reads once the table has chosen their slots,
        before the grant, counters and attribution, when they are all (no side region); the result has them too.
        """
        grants = self.grants
        if key in grants.pending or key in grants.held or key in grants.deferred:  # Grants.known, inline
            raise AssertionError(f"grant {key} asked for twice")
        if self.heat is not None:
            self.heat.count(key[0], key[1], experts)
        out = self._admit(key, experts, now, reads_now)
        recall = self.attribution.take_recall() if self.attribution.recall else ()
        if out is None:
            self._defer(key, experts, now)
            return AcquireResult(recall=recall)
        loads, ready, promotions = out
        return AcquireResult(tuple(loads), ready, tuple(promotions), recall)

    def present(self, key: GrantKey) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(experts, slots) of grant `key` already in memory while the rest is read (`Grants.present`)."""
        return self.grants.present(key)

    def reserved(self, layer: int, before: GrantKey | None = None) -> set[int]:
        """Experts of the acquires deferred at `layer` (those deferred before `before`, when it is one)."""
        return self.grants.reserved(layer, before)

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
        self.grants.deferred[key] = Deferred(tuple(experts), now, tuple(in_side))

    def _admit(self, key: GrantKey, experts: Sequence[int], now: float, reads_now: Callable[[Sequence[Load]], None]
               | None = None) -> tuple[Sequence[Load], Grant | None, list[Promotion]] | None:
        """Grant `key` now if its resident part has a slot for each miss: the reads to issue, the grant if
        complete and the prefetches it waits for; None: it must wait for slots still loading. CapacityError
        (nothing changed) when the resident region cannot give its part even once the reads are done."""
        layer = key[1]
        side = self.sides.get(layer)
        table = self.tables[layer]
        if side is None and not self.grants.deferred and table.all_ready(experts):
            # All hits: no room check, split or promotion (they, and every pin, hold and read, have slots).
            in_side, promoted, splan = [], [], None
            plan = AcquirePlan(table.acquire_ready(experts), (), ())
        else:
            in_side, main_part = self._split(layer, experts)
            # Acquires deferred before this one keep their room: one made later must not take it, or they could
            # wait forever once the reads are done. One deferred itself counts only those before it, as when it
            # was accepted (after it, each was checked against its room).
            reserved = self.grants.reserved(layer, before=key) if self.grants.deferred else set()
            if len(main_part) > (room := table.room_ever(main_part, reserved)):
                raise CapacityError(
                    f"layer {layer}: a step needs {len(main_part)} distinct experts, {room} of "
                    f"{table.capacity} slots are usable (the rest are pinned, held or kept for waiting acquires)"
                )
            if table.loading_any() and not table.can_acquire_now(main_part):  # else implied by the room check
                return None
            promoted = self.placement.promote(layer, experts, main_part, reserved) if in_side else []
            if promoted:
                in_side, main_part = self._split(layer, experts)
            plan = table.acquire(main_part)
            # the side region's part is held before a demand load's victim moves there and takes a side slot
            splan = side.acquire(in_side) if in_side and side is not None else None
            if reads_now is not None and plan.loads and splan is None and isinstance(self.placement, SidePlacement):
                reads_now(plan.loads)  # SidePlacement.demand's loads: the plan's
        slot_of = dict(plan.hits) | dict(plan.waiting) | {ld.expert: ld.slot for ld in plan.loads}
        gen_of = {e: table.generation[s] for e, s in slot_of.items()}
        hits = len(plan.hits)
        missing = {e for e, _ in plan.waiting} | {ld.expert for ld in plan.loads}
        demand = self.placement.demand(layer, plan, slot_of, gen_of, promoted)
        c = self.tally.layers[layer]
        c.side_hits += demand.side_hits
        c.victim_hits += demand.victim_hits
        promotions = [(layer, e, slot_of[e]) for e in sorted(demand.late)] if demand.late else []
        if splan is not None:
            assert side is not None and not splan.loads  # all present: hits or loading, never a load
            for e, s in (*splan.hits, *splan.waiting):
                slot_of[e] = self.placement.side_slot(layer, s)
                gen_of[e] = side.generation[s]
            hits += len(splan.hits)
            c.side_hits += len(splan.hits)
            c.victim_hits += self.placement.victims(layer, [e for e, _ in splan.hits])
            for e, _ in splan.waiting:  # a prefetch still on its way: the step now waits for it
                missing.add(e)
                promotions.append((layer, e, slot_of[e]))
        c.hits += hits
        c.misses += len(missing)
        self.tally.loads(layer, plan.loads)
        self.attribution.attribute(layer, experts, missing, side, demand.late)
        grant = Grant(key, tuple(experts), [slot_of[e] for e in experts], [gen_of[e] for e in experts], missing,
                      hits, len(missing), now, frozenset(in_side))
        return demand.loads, self.grants.open(grant), promotions

    def prefetch(self, step: int, source: int, layer: int, ranked: Sequence[tuple[int, float]]) -> list[Load]:
        """Plan the prefetch of `ranked` candidates (best first) for `layer`, hinted at MoE layer `source`.

        Returns the loads to issue; experts already in memory or on their way are skipped, and
        those over a budget (or with no slot to take) are dropped.
        """
        side = self.sides.get(layer)
        main = self.tables[layer]
        attribution, gate, placement = self.attribution, self.gate, self.placement
        attribution.hint(layer, (e for e, _ in ranked))
        if not placement.can_prefetch(layer):
            return []
        ahead = gate.ahead(source, layer)
        loads: list[Load] = []
        for e, _ in ranked:
            if e in main.slot_of or (side is not None and e in side.slot_of):
                continue
            over = gate.over(step, layer, ahead, len(attribution.step_unused), len(loads))
            ld = None if over else placement.place(layer, e)
            if ld is None:
                attribution.dropped(layer, e)
                continue
            if ld.evicted >= 0:
                attribution.wasted(layer, ld.evicted)
            attribution.issued(layer, e)
            gate.issued(step, layer)
            self.tally.prefetches_issued += 1
            placement.prefetch_issued(layer, e)
            loads.append(ld)
        return loads

    def read_expired(self, layer: int, expert: int, slot: int) -> bool:
        """A prefetch's deadline passed before it started. True: a step waits for it, read it as demand."""
        self.gate.reads_out -= 1
        self.tally.prefetches_expired += 1
        table, local = self.placement.table_of(layer, slot)
        if self.grants.waited_for(layer, expert) or expert in table.held:  # held: a deferred acquire counts on it
            self.gate.reads_out += 1  # it goes out again, now as a demand read
            return True
        table.cancel_load(expert, local)
        self.placement.prefetch_cancelled(layer, expert)
        self.attribution.expired(layer, expert)
        return False

    def read_done(self, layer: int, expert: int, slot: int) -> ReadResult:
        """The read of (`layer`, `expert`) into `slot` finished: the reads and grants that follow."""
        table, local = self.placement.table_of(layer, slot)
        table.loaded(expert, local)
        grants = self.grants
        waited_for = (layer, expert) in grants.waiters
        if self.placement.prefetch_landed(layer, expert, table):
            self.gate.reads_out -= 1
            self.attribution.landed(layer, expert, waited_for=waited_for)
        if not waited_for:  # a prefetch no step waits for yet (most reads, with prediction on)
            if not grants.deferred:
                return NOTHING_READ
            done, landed = [], []
        else:
            done, landed = grants.read_done(layer, expert)
        if not grants.deferred:  # nothing to take up (the common case: skip building a second result)
            return ReadResult(grants=tuple(done), landed=tuple(landed)) if done or landed else NOTHING_READ
        more = self.retry_deferred(layer)
        return ReadResult(more.loads, (*done, *more.grants), tuple(landed), more.promotions)

    def retry_deferred(self, layer: int) -> ReadResult:
        """Take up the acquires deferred at `layer` that a slot now lets through: their reads and complete grants."""
        loads: list[Load] = []
        done: list[Grant] = []
        promotions: list[Promotion] = []
        for key, d in list(self.grants.deferred.items()):
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
                self.grants.deferred[key] = attrs.evolve(d, side=tuple(in_side))
                continue
            del self.grants.deferred[key]
            more, g, promo = out
            loads += more
            promotions += promo
            if g is not None:
                done.append(g)
        return ReadResult(loads=tuple(loads), grants=tuple(done), promotions=tuple(promotions))

    def release(self, key: GrantKey, token_experts: Sequence[int] = (), token_slots: Sequence[int] = ()) -> None:
        """End grant `key` (complete, or still pending when its step was cancelled).

        With `token_experts` / `token_slots`, first check that every pair is what the grant
        gave and the table still holds (route verification); RouteError if not.
        """
        if (d := self.grants.deferred.pop(key, None)) is not None:
            if d.side:
                self.sides[key[1]].release(d.side)
            return
        g = self.grants.held.pop(key, None) or self.grants.pending.pop(key, None)
        if g is None:
            raise AssertionError(f"release of unknown grant {key}")
        if token_experts:
            self.placement.verify(key, g, token_experts, token_slots)
        self.tables[key[1]].release([e for e in g.experts if e not in g.side])
        if g.side:
            self.sides[key[1]].release(g.side)

    def forward_done(self) -> None:
        if self.heat is not None:
            self.heat.forward_done()
        for t in self.tables.values():
            t.forward_done()
        self.gate.forward_done()
        self.attribution.forward_done()
        for layer, side in self.sides.items():
            side.forward_done()
            if not self.side_persistent:  # the side region holds one step's speculation only
                for e in side.clear_unused():
                    self.attribution.wasted(layer, e)


__all__ = ["NOTHING_READ", "AcquireResult", "Deferred", "Grant", "GrantKey", "HintFate", "LayerCounters", "MissKind",
           "PoolOptions", "PoolPolicy", "PoolStatistics", "PrefetchBudgets", "Promotion", "ReadResult", "SlotMap"]
