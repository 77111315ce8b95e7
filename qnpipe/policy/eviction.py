"""Eviction policies: which resident expert of a layer gives up its slot.

`Eviction` (qnpipe.policy.eviction_protocol, re-exported here) is the interface every policy
implements, the built-in ones and the plug-ins `pool.evict_policy = "package.module:Class"` names
(`qnpipe.policy.eviction_plugin`, docs/pool.md). The score policies here (LRU, FIFO, LFU, LRFU)
keep a score per resident expert and evict the lowest among the evictable ones (never held, pinned or loading: the
table says which are blocked). Scores are unique (time is the table's access counter, a
tie-breaker in every score), so the victim does not depend on the order candidates are
looked at, and a policy is deterministic and clock-free. `pick` finds it without a scan in
the common case (an ordered dict for LRU and FIFO; set differences and a keyed min in C for
LFU); `victim` is the plain minimum over given candidates, the reference `pick` is tested
against (tests/policy/test_slot_table.py). The queue policies of libCacheSim (CLOCK, SIEVE,
ARC, S3-FIFO) are in their own modules: their `pick` moves a hand or queues, and their
`victim` is what that `pick` would return, found without changing anything.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable

import attrs

from qnpipe.config import EvictPolicy
from qnpipe.policy.eviction_arc import ARC
from qnpipe.policy.eviction_hand import Clock, Sieve
from qnpipe.policy.eviction_plugin import make_plugin
from qnpipe.policy.eviction_protocol import Eviction
from qnpipe.policy.eviction_s3fifo import S3FIFO

TICK_BITS = 48  # ticks count accesses of one layer: 2^48 outlasts any run


@attrs.define(slots=True)
class LRU:
    """Least recently used."""

    last: dict[int, int] = attrs.field(factory=dict)  # in tick order: an access moves the expert to the end

    def inserted(self, expert: int, tick: int) -> None:
        self.last[expert] = tick

    def accessed(self, expert: int, tick: int) -> None:
        del self.last[expert]
        self.last[expert] = tick

    def removed(self, expert: int) -> None:
        del self.last[expert]

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        return min(candidates, key=self.last.__getitem__)

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        for e in self.last:
            if e not in loading and e not in held and e not in pinned:
                return e
        return None

    def forward_done(self) -> None:
        pass


@attrs.define(slots=True)
class FIFO:
    """First in, first out: the oldest insertion leaves, whatever its use."""

    born: dict[int, int] = attrs.field(factory=dict)

    def inserted(self, expert: int, tick: int) -> None:
        self.born[expert] = tick

    def accessed(self, expert: int, tick: int) -> None:
        pass

    def removed(self, expert: int) -> None:
        del self.born[expert]

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        return min(candidates, key=self.born.__getitem__)

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        for e in self.born:  # in insertion order, which is tick order
            if e not in loading and e not in held and e not in pinned:
                return e
        return None

    def forward_done(self) -> None:
        pass


@attrs.define(slots=True)
class LFU:
    """Least frequently used, ties to the least recent; counts halve every `decay_interval` forwards.

    Counts persist while an expert is out of the pool (a returning hot expert keeps its
    history): the previous system's behaviour, and what its measured default assumes.
    """

    decay_interval: int = 0
    count: dict[int, int] = attrs.field(factory=dict)
    last: dict[int, int] = attrs.field(factory=dict)
    # (count, last) packed in one int, so the victim search is a plain min over a dict lookup.
    key: dict[int, int] = attrs.field(factory=dict)
    forwards: int = 0

    def inserted(self, expert: int, tick: int) -> None:
        self.accessed(expert, tick)

    def accessed(self, expert: int, tick: int) -> None:
        c = self.count[expert] = self.count.get(expert, 0) + 1
        self.last[expert] = tick
        self.key[expert] = (c << TICK_BITS) | tick

    def removed(self, expert: int) -> None:
        del self.last[expert]
        del self.key[expert]

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        return min(candidates, key=self.key.__getitem__)

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        # Set differences and a keyed min, all in C: faster at pool sizes than a heap kept in Python.
        free = self.key.keys() - loading
        free.difference_update(held, pinned)
        return min(free, key=self.key.__getitem__) if free else None

    def pick_many(self, n: int, loading: Collection[int], held: Collection[int], pinned: Collection[int]) -> list[int]:
        """What `n` picks in a row would give, each victim removed and its incoming expert inserted (loading)
        between them: the keys of the others do not change, so it is the `n` least keys, in order. One set
        and one partial sort instead of `n` (an acquire's misses). Fewer when fewer are evictable.
        `heapq.nsmallest` is documented equal to a whole sort's first `n`; the sort, all in C, is the faster of
        the two up to ~128 keys (32 keys, 6 picks: 1.6 µs against 6.0; 256 keys, 3 picks: 19.3 against 14.5)."""
        free = self.key.keys() - loading
        free.difference_update(held, pinned)
        if len(free) <= 128:
            return sorted(free, key=self.key.__getitem__)[:n]
        return heapq.nsmallest(n, free, key=self.key.__getitem__)

    def forward_done(self) -> None:
        self.forwards += 1
        if self.decay_interval and self.forwards % self.decay_interval == 0:
            self.count = {e: c >> 1 for e, c in self.count.items() if c > 1 or e in self.last}
            self.key = {e: (self.count.get(e, 0) << TICK_BITS) | t for e, t in self.last.items()}


@attrs.define(slots=True)
class LRFU:
    """Frequency with recency (Lee et al.'s LRFU): score = sum over accesses of 2^(-lam * age).

    lam -> 0 is LFU, lam = 1 is close to LRU. Kept in the log domain
    (key = log2(crf) + lam * last_tick) so no global decay pass is needed. Like LFU, the
    history of an expert outlives its stay in the pool.
    """

    lam: float = 0.05
    key: dict[int, float] = attrs.field(factory=dict)
    resident: set[int] = attrs.field(factory=set)

    def inserted(self, expert: int, tick: int) -> None:
        self.resident.add(expert)
        self.accessed(expert, tick)

    def accessed(self, expert: int, tick: int) -> None:
        now = self.lam * tick
        old = self.key.get(expert)
        # crf(t) = 1 + crf(last) * 2^(-lam (t - last)), in log2 terms relative to `now`.
        self.key[expert] = now + (0.0 if old is None else math.log2(1.0 + 2.0 ** (old - now)))

    def removed(self, expert: int) -> None:
        self.resident.discard(expert)

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        return min(candidates, key=lambda e: (self.key[e], e))

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        free = [e for e in self.resident if e not in loading and e not in held and e not in pinned]
        return self.victim(free, incoming) if free else None

    def forward_done(self) -> None:
        pass


def make_eviction(kind: str, capacity: int, *, lfu_decay_interval: int = 0, lrfu_lambda: float = 0.05,
                  watchdog_s: float = 0.0) -> Eviction:
    """A fresh policy for one layer of `capacity` slots: an `EvictPolicy`, or a plug-in's "package.module:Class"
    (its answers checked; `watchdog_s`, diag.watchdog_s, bounds one of its calls: qnpipe.hang_guard)."""
    match kind:
        case EvictPolicy.LRU:
            return LRU()
        case EvictPolicy.LFU:
            return LFU(decay_interval=lfu_decay_interval)
        case EvictPolicy.FIFO:
            return FIFO()
        case EvictPolicy.LRFU:
            return LRFU(lam=lrfu_lambda)
        case EvictPolicy.CLOCK:
            return Clock()
        case EvictPolicy.SIEVE:
            return Sieve()
        case EvictPolicy.ARC:
            return ARC(capacity)
        case EvictPolicy.S3FIFO:
            return S3FIFO(capacity)
        case _:
            return make_plugin(kind, capacity, watchdog_s)
