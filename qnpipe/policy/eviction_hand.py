"""CLOCK and SIEVE: one queue and a hand, as libCacheSim's Clock.c and Sieve.c do it.

Both give a resident expert a small counter that an access raises and the hand lowers; the
hand evicts the first expert whose counter is 0. They differ in where the hand is: CLOCK's
is always at the oldest end of the queue (a survivor goes back to the newest end), SIEVE's
stays where it stopped and experts never move.

Blocked experts (loading, held, pinned): the hand passes over them and leaves their counter
alone, as if they were not in the pool; CLOCK moves one it passes to the newest end, like
any expert the hand passes. With nothing blocked this is libCacheSim's eviction exactly
(tests/policy/test_libcachesim.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

import attrs


@attrs.define(slots=True)
class Clock:
    """CLOCK (second chance, FIFO-reinsertion) with a `bits`-bit counter per expert (libCacheSim: 1).

    Inserted with 0; an access adds 1 up to 2^bits - 1. The hand looks at the oldest expert:
    0 is evicted, else its counter drops by 1 and it goes to the newest end. The victim is
    the evictable expert with the lowest counter, the oldest of those: what `victim` computes.
    """

    bits: int = 1
    count: OrderedDict[int, int] = attrs.field(factory=OrderedDict)  # oldest first: the hand is at the front
    top: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.top = (1 << self.bits) - 1

    def inserted(self, expert: int, tick: int) -> None:
        self.count[expert] = 0

    def accessed(self, expert: int, tick: int) -> None:
        c = self.count[expert]
        if c < self.top:
            self.count[expert] = c + 1

    def removed(self, expert: int) -> None:
        del self.count[expert]

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        wanted = set(candidates)
        best, best_count = -1, self.top + 1
        for e, c in self.count.items():
            if c < best_count and e in wanted:
                best, best_count = e, c
        return best

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        count = self.count
        passed = 0  # blocked experts passed in a row: a whole turn of them means none is evictable
        while passed < len(count):
            e = next(iter(count))
            if e in loading or e in held or e in pinned:
                count.move_to_end(e)
                passed += 1
                continue
            c = count[e]
            if not c:
                return e  # stays at the front until the table removes it
            count[e] = c - 1
            count.move_to_end(e)
            passed = 0
        return None

    def forward_done(self) -> None:
        pass


@attrs.define(slots=True)
class Sieve:
    """SIEVE (Zhang et al., NSDI '24): a FIFO queue whose hand sweeps from old to new and wraps.

    An access sets the expert's visited bit; inserts go to the newest end with the bit clear.
    The hand clears the bits it passes and evicts the first expert without one; the next
    search starts from the expert after the victim (from the oldest when the victim was the
    newest). `victim`: the first evictable expert without the bit from the hand on, else
    the first evictable one from the hand on.
    """

    queue: list[int] = attrs.field(factory=list)  # oldest first; an expert never moves
    visited: dict[int, bool] = attrs.field(factory=dict)
    hand: int = 0  # index into `queue` where the next search starts

    def inserted(self, expert: int, tick: int) -> None:
        self.queue.append(expert)
        self.visited[expert] = False

    def accessed(self, expert: int, tick: int) -> None:
        self.visited[expert] = True

    def removed(self, expert: int) -> None:
        i = self.queue.index(expert)
        del self.queue[i]
        del self.visited[expert]
        if i < self.hand:
            self.hand -= 1
        if self.hand >= len(self.queue):  # the victim was the newest: start from the oldest again
            self.hand = 0

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        wanted = set(candidates)
        first = -1
        for e in self.queue[self.hand:] + self.queue[:self.hand]:
            if e in wanted:
                if not self.visited[e]:
                    return e
                if first < 0:
                    first = e
        return first

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        queue, visited = self.queue, self.visited
        n = len(queue)
        i = self.hand
        free_seen = False
        for looked in range(2 * n + 1):
            if looked == n and not free_seen:
                return None
            e = queue[i]
            if e not in loading and e not in held and e not in pinned:
                free_seen = True
                if not visited[e]:
                    self.hand = i
                    return e
                visited[e] = False
            i = i + 1 if i + 1 < n else 0
        raise AssertionError("SIEVE's hand went twice round an evictable expert")  # the bits it cleared stay clear

    def forward_done(self) -> None:
        pass


__all__ = ["Clock", "Sieve"]
