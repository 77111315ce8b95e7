"""The pool policy's counters: per layer (`LayerCounters`) and over the pool (`PoolCounters`).

`PoolCounters.statistics()` is the one place they are added up (`PoolStatistics`): the engine's
stats and the replay report are both made from that snapshot.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs

from qnpipe.policy.slot_table import Load, LoadCause


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


@attrs.define(slots=True)
class LayerCounters:
    hits: int = 0
    side_hits: int = 0  # of hits, served beyond the resident region (prefetched, or kept as a victim)
    victim_hits: int = 0  # ... of them by the side region keeping what the resident region gave up (no prefetch read)
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
    victim_hits: int = 0  # of side_hits, a victim cache's (pool.prefetch_into=main), not a prefetch's

    @property
    def prefetch_hits(self) -> int:
        """Hits a prefetch read made: the side hits less the victim region's."""
        return self.side_hits - self.victim_hits

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def recall(self) -> float:
        return self.predicted_used / self.used if self.used else 0.0


@attrs.define
class PoolCounters:
    """The live counters: `layers` per MoE layer, the rest over the whole pool.

    Reads and their bytes are the read side's to count (`ReadSchedulerStats`: the one count of
    what left the device), and prefetch reads done the layers' (`LayerCounters.prefetch_reads`,
    summed as both `prefetch_reads` and `prefetches_done`): nothing is counted twice."""

    record_nbytes: Mapping[int, int]
    layers: dict[int, LayerCounters]
    prefetches_issued: int = 0
    prefetches_used: int = 0
    prefetches_expired: int = 0
    hints_dropped_budget: int = 0
    wasted_bytes: int = 0

    @classmethod
    def of(cls, layers: Iterable[int], record_nbytes: Mapping[int, int]) -> PoolCounters:
        return cls(record_nbytes, {layer: LayerCounters() for layer in layers})

    def loads(self, layer: int, loads: Iterable[Load]) -> None:
        """Demand loads: each a cold or capacity load (cold + capacity = loads = reads), some evicting."""
        c = self.layers[layer]
        for ld in loads:
            if ld.cause is LoadCause.COLD:
                c.cold += 1
            else:
                c.capacity += 1
            c.evictions += ld.evicted >= 0

    def prefetch_used(self, layer: int) -> None:
        self.prefetches_used += 1
        self.layers[layer].prefetch_used += 1

    def statistics(self) -> PoolStatistics:
        layers = {layer: attrs.evolve(c, causes=dict(c.causes)) for layer, c in self.layers.items()}
        cs = layers.values()
        prefetch_reads = sum(c.prefetch_reads for c in cs)
        causes: dict[str, int] = {}
        for c in cs:
            for kind, n in c.causes.items():
                causes[str(kind)] = causes.get(str(kind), 0) + n
        return PoolStatistics(
            layers=layers, hits=sum(c.hits for c in cs), misses=sum(c.misses for c in cs),
            side_hits=sum(c.side_hits for c in cs), used=sum(c.used for c in cs),
            predicted_used=sum(c.predicted_used for c in cs), prefetch_reads=prefetch_reads,
            prefetch_used=sum(c.prefetch_used for c in cs), causes=causes, prefetches_issued=self.prefetches_issued,
            prefetches_done=prefetch_reads, prefetches_used=self.prefetches_used,
            prefetches_expired=self.prefetches_expired, hints_dropped_budget=self.hints_dropped_budget,
            wasted_bytes=self.wasted_bytes, victim_hits=sum(c.victim_hits for c in cs))


__all__ = ["LayerCounters", "MissKind", "PoolCounters", "PoolStatistics"]
