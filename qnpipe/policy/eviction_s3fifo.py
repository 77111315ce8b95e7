"""S3-FIFO (Yang et al., SOSP '23), as libCacheSim's S3FIFO.c does it.

Three FIFO queues: a small one (10 % of the slots), a main one (the rest) and a ghost of
evicted ids (90 % of the slots, ids only). A miss goes into main when its id is in the ghost,
else into small (into main too while small is full and nothing was evicted yet). An access
adds 1 to the expert's count. When the pool needs a slot it evicts from main when main holds
more than its share or small is empty, else from small:

- small: its oldest expert moves to main (count 0) when its count is 2 or more and the next
  one is looked at; else it is the victim and its id goes into the ghost (the ghost's oldest
  id leaves when it is full). Small running empty means main gives the victim;
- main: its oldest expert with a count goes back to main's newest end with min(count, 3) - 1
  (a 2-bit CLOCK); the first with 0 is the victim.

Blocked experts (loading, held, pinned) are passed over: each goes to the newest end of its
own queue unchanged; when a queue has nothing evictable the other one gives the victim. With
nothing blocked this is libCacheSim's S3-FIFO exactly (tests/policy/test_libcachesim.py) at
20 slots and more. Below, libCacheSim differs: it needs a small queue larger than one
object, so with unit-size experts it caches nothing below 20 slots and refuses to start
below 10; the pool must take every expert a step needs, so here the small queue has
max(1, 10 %) of the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

import attrs

SMALL_RATIO = 0.10  # libCacheSim's small-size-ratio
GHOST_RATIO = 0.90  # ghost-size-ratio
MOVE_TO_MAIN = 2  # move-to-main-threshold


def _evict_small(small: OrderedDict[int, int], main: OrderedDict[int, int],
                 blocked: Callable[[int], bool]) -> int | None:
    for _ in range(len(small)):
        e, count = next(iter(small.items()))
        if blocked(e):
            small.move_to_end(e)
        elif count >= MOVE_TO_MAIN:
            del small[e]
            main[e] = 0
        else:
            return e  # stays oldest until the table removes it
    return None


def _evict_main(main: OrderedDict[int, int], blocked: Callable[[int], bool]) -> int | None:
    passed = 0  # blocked experts passed in a row: a whole turn of them means none is evictable
    while passed < len(main):
        e, count = next(iter(main.items()))
        if blocked(e):
            main.move_to_end(e)
            passed += 1
        elif count:
            main.move_to_end(e)
            main[e] = min(count, 3) - 1
            passed = 0
        else:
            return e  # stays oldest until the table removes it
    return None


def _choose(small: OrderedDict[int, int], main: OrderedDict[int, int], main_size: int,
            blocked: Callable[[int], bool]) -> int | None:
    """The victim; moves experts between and within the queues as the search does."""
    if len(main) > main_size or not small:
        v = _evict_main(main, blocked)
        if v is None:
            v = _evict_small(small, main, blocked)
        if v is None:  # small may have moved evictable experts into main
            v = _evict_main(main, blocked)
        return v
    v = _evict_small(small, main, blocked)
    return v if v is not None else _evict_main(main, blocked)


@attrs.define(slots=True)
class S3FIFO:
    """S3-FIFO for one layer of `capacity` slots."""

    capacity: int
    small_size: int = attrs.field(init=False)
    main_size: int = attrs.field(init=False)
    ghost_size: int = attrs.field(init=False)
    small: OrderedDict[int, int] = attrs.field(factory=OrderedDict)  # expert -> count, oldest first
    main: OrderedDict[int, int] = attrs.field(factory=OrderedDict)
    ghost: OrderedDict[int, None] = attrs.field(factory=OrderedDict)  # oldest first
    has_evicted: bool = False
    arriving: int = -1  # the miss `pick` counted, and whether its id was in the ghost
    ghost_hit: bool = False
    chosen: int = -1  # what `pick` chose: its id goes into the ghost when it leaves small

    def __attrs_post_init__(self) -> None:
        # As libCacheSim computes them (int64 * double, truncated), the small queue never empty.
        self.small_size = max(1, int(self.capacity * SMALL_RATIO))
        self.main_size = self.capacity - self.small_size
        self.ghost_size = int(self.capacity * GHOST_RATIO)

    def inserted(self, expert: int, tick: int) -> None:
        if self.arriving != expert:  # a free slot: no pick came first
            self._arrive(expert)
        if self.ghost_hit or (not self.has_evicted and len(self.small) >= self.small_size):
            self.main[expert] = 0
        else:
            self.small[expert] = 0
        self.arriving, self.ghost_hit = -1, False

    def accessed(self, expert: int, tick: int) -> None:
        q = self.small if expert in self.small else self.main
        q[expert] += 1

    def removed(self, expert: int) -> None:
        if expert in self.small:
            del self.small[expert]
            if expert == self.chosen and self.ghost_size:
                ghost = self.ghost
                if expert not in ghost:
                    if len(ghost) >= self.ghost_size:
                        ghost.popitem(last=False)
                    ghost[expert] = None
        else:
            del self.main[expert]
        if expert == self.chosen:
            self.chosen = -1

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        wanted = set(candidates)
        v = _choose(OrderedDict(self.small), OrderedDict(self.main), self.main_size, lambda e: e not in wanted)
        assert v is not None, "no candidate is resident"
        return v

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        v = _choose(self.small, self.main, self.main_size, lambda e: e in loading or e in held or e in pinned)
        if v is None:
            return None
        self.has_evicted = True
        self._arrive(incoming)
        self.chosen = v
        return v

    def forward_done(self) -> None:
        pass

    def _arrive(self, expert: int) -> None:
        """Count the miss of `expert` once: a ghost hit takes its id out of the ghost."""
        if self.arriving == expert:
            return
        self.arriving = expert
        self.ghost_hit = expert in self.ghost
        if self.ghost_hit:
            del self.ghost[expert]


__all__ = ["S3FIFO"]
