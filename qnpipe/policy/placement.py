"""Where a layer's prefetches land and how its two regions share one stacked array of slots.

A layer's slots are one stacked array: the resident region's (`tables[layer]`) and the side
region's (`sides[layer]`). `SidePlacement` (pool.prefetch_into=side) keeps them fixed, the side
slots after the resident ones, and prefetches land in the side region. `MainPlacement`
(pool.prefetch_into=main) lands prefetches in the resident region and lets the side region keep
what the resident region gave up: an expert moves between the regions by relabelling its slot
(`SlotMap`), never by a copy (docs/pool.md, "Prefetch placement"). The pool policy
(qnpipe.policy.pool) asks its placement each question whose answer depends on which it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import msgspec

from qnpipe.errors import RouteError
from qnpipe.policy.pool_attribution import Attribution
from qnpipe.policy.pool_grants import Grant, GrantKey
from qnpipe.policy.slot_table import FREE, AcquirePlan, Load, SlotState, SlotTable


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


class DemandPlan(msgspec.Struct, frozen=True):
    """An acquire's demand loads (physical slots), the prefetches it now waits for (`late`, read as demand)
    and the hits prefetches made in the resident region (counted as side hits), of them `victim_hits` served
    by the side region keeping what the resident region gave up (no prefetch read). A frozen msgspec Struct:
    one is made per acquire, on the replay's hot path."""

    loads: Sequence[Load]
    late: frozenset[int] | set[int] = frozenset()
    side_hits: int = 0
    victim_hits: int = 0


@attrs.define
class _Regions:
    """A layer's regions at fixed places: side slot `s` is physical slot `capacity + s`."""

    tables: dict[int, SlotTable]
    sides: dict[int, SlotTable]

    def table_of(self, layer: int, slot: int) -> tuple[SlotTable, int]:
        """The table of physical slot `slot` and its slot there."""
        main = self.tables[layer]
        if slot >= main.capacity:
            return self.sides[layer], slot - main.capacity
        return main, slot

    def side_slot(self, layer: int, s: int) -> int:
        """The physical slot of side slot `s`."""
        return self.tables[layer].capacity + s

    def verify(self, key: GrantKey, g: Grant, token_experts: Sequence[int], token_slots: Sequence[int]) -> None:
        """Route verification: each (expert, physical slot) a token read is what grant `g` gave and its table
        still holds. RouteError if not."""
        layer = key[1]
        gens = dict(zip(g.slots, g.generations, strict=True))
        cap = self.tables[layer].capacity
        pairs = list(zip(token_experts, token_slots, strict=True))
        for t, sel, off in ((self.tables[layer], [p for p in pairs if p[1] < cap], 0),
                            (self.sides.get(layer), [p for p in pairs if p[1] >= cap], cap)):
            if not sel:
                continue
            if t is None:
                raise RouteError(f"route verification failed at step {key[0]}: layer {layer} has no side "
                                 f"region, yet a token read slot {sel[0][1]}")
            err = t.verify([e for e, _ in sel], [s - off for _, s in sel],
                           {s - off: gen for s, gen in gens.items() if (s >= cap) == (off > 0)})
            if err is not None:
                raise RouteError(f"route verification failed at step {key[0]}: {err}")


@attrs.define
class SidePlacement(_Regions):
    """pool.prefetch_into=side: the regions stay fixed and prefetches land in the side region (none
    where a layer has no side region)."""

    def promote(self, layer: int, experts: Sequence[int], main_part: list[int], reserved: set[int]) -> list[int]:
        """The side-region experts of an acquire moved to the resident region: none, regions are fixed."""
        return []

    def demand(self, layer: int, plan: AcquirePlan, slot_of: dict[int, int], gen_of: dict[int, int],
               promoted: list[int]) -> DemandPlan:
        """The resident region's slots are physical already; its victims leave memory."""
        return DemandPlan(plan.loads)

    def can_prefetch(self, layer: int) -> bool:
        return layer in self.sides

    def place(self, layer: int, expert: int) -> Load | None:
        """A side slot for a prefetch of `expert` (a Load with its physical slot), or None."""
        ld = self.sides[layer].prefetch(expert)
        return None if ld is None else Load(expert, self.side_slot(layer, ld.slot), ld.evicted, ld.cause)

    def prefetch_issued(self, layer: int, expert: int) -> None:
        pass

    def prefetch_landed(self, layer: int, expert: int, table: SlotTable) -> bool:
        """Whether the read of `expert` that just finished into `table` was a prefetch's."""
        return table is not self.tables[layer]

    def prefetch_cancelled(self, layer: int, expert: int) -> None:
        pass

    def victims(self, layer: int, experts: Sequence[int]) -> int:
        """Of side-region hits on `experts`, those on what the resident region gave up: none, only prefetches land here."""
        return 0


@attrs.define
class MainPlacement(_Regions):
    """pool.prefetch_into=main: prefetches land in the resident region and what they (and demand loads)
    displace moves to the side region by relabelling (`maps`, one per layer with a side region); a step
    that uses a ready side-region expert moves it back the same way. With no side region the resident
    victim leaves memory. `attribution` hears of each expert that leaves memory (a prefetch wasted)."""

    attribution: Attribution = attrs.field(kw_only=True)
    maps: dict[int, SlotMap] = attrs.field(factory=dict, kw_only=True)
    prefetching: set[tuple[int, int]] = attrs.field(factory=set, kw_only=True)  # prefetch reads not done yet

    @classmethod
    def of(cls, tables: dict[int, SlotTable], sides: dict[int, SlotTable], capacities: Mapping[int, int],
           side_slots: int, attribution: Attribution) -> MainPlacement:
        maps = {layer: SlotMap.identity(cap, side_slots) for layer, cap in capacities.items()} if sides else {}
        return cls(tables, sides, attribution=attribution, maps=maps)

    def table_of(self, layer: int, slot: int) -> tuple[SlotTable, int]:
        if (m := self.maps.get(layer)) is not None:
            in_side, local = m.at[slot]
            return (self.sides[layer] if in_side else self.tables[layer]), local
        return super().table_of(layer, slot)

    def side_slot(self, layer: int, s: int) -> int:
        m = self.maps.get(layer)
        return super().side_slot(layer, s) if m is None else m.side[s]

    def promote(self, layer: int, experts: Sequence[int], main_part: list[int], reserved: set[int]) -> list[int]:
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
        self.maps[layer].swap(r, s)

    def demand(self, layer: int, plan: AcquirePlan, slot_of: dict[int, int], gen_of: dict[int, int],
               promoted: list[int]) -> DemandPlan:
        """What each demand load evicts moves to the side region (as a prefetch's victim does) and the slots
        in `slot_of` (and the generations in `gen_of`) are made physical."""
        m = self.maps.get(layer)
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
                self.attribution.wasted(layer, evicted)
            loads.append(ld if m is None else Load(ld.expert, m.main[ld.slot], evicted, ld.cause))
        if m is not None:
            for e, s in slot_of.items():
                slot_of[e] = m.main[s]
        prefetched = {e for e, _ in plan.hits if (layer, e) in self.attribution.unused}
        late = {e for e, _ in plan.waiting if (layer, e) in self.prefetching}
        return DemandPlan(loads, late, len(prefetched.union(promoted)), self.victims(layer, promoted))

    def can_prefetch(self, layer: int) -> bool:
        return True

    def place(self, layer: int, expert: int) -> Load | None:
        """A free resident slot, else the resident eviction policy's victim, which moves to the side
        region by relabelling when the side region has a slot to give (free, or its LFU victim, which
        leaves memory), else leaves memory. With no resident slot to give, the side region takes the
        prefetch as with prefetch_into=side."""
        main, side = self.tables[layer], self.sides.get(layer)
        m = self.maps.get(layer)
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

    def prefetch_issued(self, layer: int, expert: int) -> None:
        self.prefetching.add((layer, expert))

    def prefetch_landed(self, layer: int, expert: int, table: SlotTable) -> bool:
        if (layer, expert) not in self.prefetching:
            return False
        self.prefetching.discard((layer, expert))
        return True

    def prefetch_cancelled(self, layer: int, expert: int) -> None:
        self.prefetching.discard((layer, expert))

    def victims(self, layer: int, experts: Sequence[int]) -> int:
        """Of side-region hits on `experts`, those no prefetch read brought in (not an unused prefetch): the side
        region kept them when the resident region gave them up, a victim cache's hits, not prefetching's."""
        unused = self.attribution.unused
        return sum((layer, e) not in unused for e in experts)

    def verify(self, key: GrantKey, g: Grant, token_experts: Sequence[int], token_slots: Sequence[int]) -> None:
        """As with fixed regions, each physical slot checked in the table it is in now."""
        layer = key[1]
        if layer not in self.maps:
            super().verify(key, g, token_experts, token_slots)
            return
        gens = dict(zip(g.slots, g.generations, strict=True))
        n = len(self.maps[layer].at)
        by: dict[int, tuple[SlotTable, list[int], list[int], dict[int, int]]] = {}
        for e, p in zip(token_experts, token_slots, strict=True):
            if not 0 <= p < n:
                raise RouteError(f"route verification failed at step {key[0]}: layer {layer}: a token routed to "
                                 f"expert {e} read slot {p}, which does not exist")
            t, local = self.table_of(layer, p)
            _, es, ss, gs = by.setdefault(id(t), (t, [], [], {}))
            es.append(e)
            ss.append(local)
            if p in gens:
                gs[local] = gens[p]
        for t, es, ss, gs in by.values():
            if (err := t.verify(es, ss, gs)) is not None:
                raise RouteError(f"route verification failed at step {key[0]}: {err}")


Placement = SidePlacement | MainPlacement

__all__ = ["DemandPlan", "MainPlacement", "Placement", "SidePlacement", "SlotMap"]
