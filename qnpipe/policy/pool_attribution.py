"""Miss attribution: what became of each hinted expert, and so the one cause of every miss.

`Attribution` remembers, per layer since its last acquire, the experts the predictor hinted and
the fate of each (`HintFate`), which prefetches are in memory and not used yet, and which experts
a layer ever used (a miss on one never used is `cold`). At each acquire `attribute` gives every
miss exactly one `MissKind` and counts recall and the prefetches used.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

from qnpipe.policy.pool_counters import MissKind, PoolCounters
from qnpipe.policy.slot_table import SlotTable

RecallRecord = tuple[int, int, int]  # diag.predict_recall_prof: (layer, used, predicted)


class HintFate(enum.IntEnum):
    ISSUED = 0
    DROPPED = 1
    EVICTED = 2
    EXPIRED = 3


@attrs.define
class Attribution:
    """The prefetch ledger and the miss causes; `recall`: samples kept for diag.predict_recall_prof (None: off)."""

    counters: PoolCounters
    predicting: bool = False
    recall: list[RecallRecord] | None = None
    fates: dict[int, dict[int, HintFate]] = attrs.field(factory=dict)  # since the layer's last acquire
    hinted: dict[int, set[int]] = attrs.field(factory=dict)
    unused: dict[tuple[int, int], bool] = attrs.field(factory=dict)  # prefetched, not used yet
    step_unused: set[tuple[int, int]] = attrs.field(factory=set)  # ... of them issued in the current step
    used_before: dict[int, set[int]] = attrs.field(factory=dict)

    def hint(self, layer: int, experts: Iterable[int]) -> None:
        """The predictor named `experts` for `layer`: they count as predicted at its next acquire."""
        self.hinted.setdefault(layer, set()).update(experts)

    def issued(self, layer: int, expert: int) -> None:
        self.fates.setdefault(layer, {})[expert] = HintFate.ISSUED
        self.step_unused.add((layer, expert))

    def dropped(self, layer: int, expert: int) -> None:
        self.fates.setdefault(layer, {})[expert] = HintFate.DROPPED
        self.counters.hints_dropped_budget += 1

    def expired(self, layer: int, expert: int) -> None:
        self.step_unused.discard((layer, expert))
        self.fates.setdefault(layer, {})[expert] = HintFate.EXPIRED

    def landed(self, layer: int, expert: int, waited_for: bool) -> None:
        """A prefetch's read finished (`waited_for`: a step waits for it already, so it is used)."""
        self.counters.layers[layer].prefetch_reads += 1
        if not waited_for:
            self.unused[(layer, expert)] = True

    def wasted(self, layer: int, expert: int) -> None:
        """`expert` left memory: a prefetch of it not used yet was wasted."""
        self.step_unused.discard((layer, expert))
        if self.unused.pop((layer, expert), None) is not None:
            self.counters.wasted_bytes += self.counters.record_nbytes[layer]
            self.fates.setdefault(layer, {})[expert] = HintFate.EVICTED

    def attribute(self, layer: int, experts: Sequence[int], missing: set[int], side: SlotTable | None,
                  late: frozenset[int] | set[int]) -> None:
        """Give every miss of this acquire exactly one cause; count recall and used prefetches."""
        counters = self.counters
        c = counters.layers[layer]
        seen = self.used_before.setdefault(layer, set())
        fates = self.fates.pop(layer, {})
        hinted = self.hinted.pop(layer, set())
        c.used += len(experts)
        predicted = sum(e in hinted for e in experts)
        c.predicted_used += predicted
        if self.recall is not None and self.predicting:
            self.recall.append((layer, len(experts), predicted))
        for e in experts:
            self.step_unused.discard((layer, e))
            if self.unused.pop((layer, e), None) is not None:
                counters.prefetch_used(layer)
            if e not in missing:
                continue
            fate = fates.get(e)
            if (side is not None and e in side.slot_of) or e in late:  # its prefetch is on the way: used, late
                kind = MissKind.LATE
                counters.prefetch_used(layer)
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

    def take_recall(self) -> tuple[RecallRecord, ...]:
        """The recall samples kept since the last call."""
        if not self.recall:
            return ()
        out = tuple(self.recall)
        self.recall.clear()
        return out

    def forward_done(self) -> None:
        self.step_unused.clear()


__all__ = ["Attribution", "HintFate", "RecallRecord"]
