"""ARC (Megiddo and Modha, FAST '03), as libCacheSim's ARC.c does it.

Two LRU lists of residents, T1 (seen once since it last entered) and T2 (seen again), and two
ghost lists of evicted ids, B1 and B2; `p` is T1's target size. A hit in T1 or T2 moves the
expert to T2's most recent end. A miss that finds the expert in B1 raises `p` by
max(|B2| / |B1|, 1) (at most `capacity`), one in B2 lowers it by max(|B1| / |B2|, 1) (at
least 0), and the expert comes back into T2; any other miss comes into T1. The victim, when
the pool is full, is T1's least recent expert (into B1) when |T1| > 0 and (|T1| > p, or
|T1| = p and the miss was in B2), or T2 is empty; else T2's (into B2). A miss in no list
first trims the ghosts: when |T1| + |B1| reaches `capacity`, B1's oldest goes, or, B1 being
empty, T1's least recent is evicted with no ghost; else when all four lists hold 2 x
`capacity`, B2's oldest goes. All of it happens when the pool needs a slot, as in
libCacheSim, where nothing is evicted (and no ghost exists) before the cache is full.

Blocked experts (loading, held, pinned): the least recent expert of a list is its least
recent evictable one; when the list ARC names has none, the other list gives the victim (into
its own ghost list). With nothing blocked this is libCacheSim's ARC exactly
(tests/policy/test_libcachesim.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

import attrs

_T1, _T2 = 1, 2


@attrs.define(slots=True)
class ARC:
    """Adaptive replacement cache for one layer of `capacity` slots."""

    capacity: int
    t1: OrderedDict[int, None] = attrs.field(factory=OrderedDict)  # least recent first
    t2: OrderedDict[int, None] = attrs.field(factory=OrderedDict)
    b1: OrderedDict[int, None] = attrs.field(factory=OrderedDict)  # oldest first
    b2: OrderedDict[int, None] = attrs.field(factory=OrderedDict)
    p: float = 0.0
    # The miss being served: `pick` settles its ghost hit (and adapts p) before choosing, `inserted` places it.
    arriving: int = -1
    ghost_hit: int = 0  # 0, or the ghost list (_T1 = B1, _T2 = B2) it was found in
    # What `pick` chose: the victim and the ghost list it goes to when removed (0: none).
    chosen: int = -1
    chosen_ghost: int = 0

    def inserted(self, expert: int, tick: int) -> None:
        if self.arriving != expert:  # a free slot: no pick came first
            self._arrive(expert)
        (self.t2 if self.ghost_hit else self.t1)[expert] = None
        self.arriving, self.ghost_hit = -1, 0

    def accessed(self, expert: int, tick: int) -> None:
        if expert in self.t1:
            del self.t1[expert]
            self.t2[expert] = None
        else:
            self.t2.move_to_end(expert)

    def removed(self, expert: int) -> None:
        if expert in self.t1:
            del self.t1[expert]
        else:
            del self.t2[expert]
        if expert == self.chosen:
            if self.chosen_ghost:
                (self.b1 if self.chosen_ghost == _T1 else self.b2)[expert] = None
            self.chosen = -1

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        wanted = set(candidates)
        victim, _, _, _ = self._plan(incoming, lambda e: e not in wanted)
        assert victim is not None, "no candidate is resident"
        return victim

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        victim, ghost, trim1, trim2 = self._plan(
            incoming, lambda e: e in loading or e in held or e in pinned)
        if victim is None:
            return None
        self._arrive(incoming)
        if trim1:
            self.b1.popitem(last=False)
        if trim2:
            self.b2.popitem(last=False)
        self.chosen, self.chosen_ghost = victim, ghost
        return victim

    def forward_done(self) -> None:
        pass

    # ------------------------------------------------------------------ the rules

    def _adapted(self, incoming: int) -> tuple[float, int]:
        """(p, ghost hit) once the miss of `incoming` is counted."""
        if self.arriving == incoming:
            return self.p, self.ghost_hit
        nb1, nb2 = len(self.b1), len(self.b2)
        if incoming in self.b1:
            return min(self.p + max(nb2 / nb1, 1.0), float(self.capacity)), _T1
        if incoming in self.b2:
            return max(self.p - max(nb1 / nb2, 1.0), 0.0), _T2
        return self.p, 0

    def _arrive(self, expert: int) -> None:
        """Count the miss of `expert` once: adapt p and take it out of its ghost list."""
        if self.arriving == expert:
            return
        self.p, self.ghost_hit = self._adapted(expert)
        if self.ghost_hit == _T1:
            del self.b1[expert]
        elif self.ghost_hit == _T2:
            del self.b2[expert]
        self.arriving = expert

    def _plan(self, incoming: int, blocked: Callable[[int], bool]) -> tuple[int | None, int, bool, bool]:
        """(victim, its ghost list, trim B1's oldest, trim B2's oldest) for the miss of `incoming`; changes nothing."""
        p, hit = self._adapted(incoming)
        nt1, nt2, nb1, nb2 = len(self.t1), len(self.t2), len(self.b1), len(self.b2)
        trim1 = trim2 = False
        ghost_of_t1 = _T1
        if hit:
            from_t1 = self._replace_t1(nt1, nt2, p, hit)
        elif nt1 + nb1 + 1 > self.capacity:  # case IV A: L1 = T1 + B1 is full
            if nb1:
                trim1 = True
                from_t1 = self._replace_t1(nt1, nt2, p, hit)
            else:
                from_t1, ghost_of_t1 = True, 0  # T1 fills the cache: its LRU goes, no ghost
        else:  # case IV B
            trim2 = nt1 + nb1 + nt2 + nb2 >= 2 * self.capacity and nb2 > 0
            from_t1 = self._replace_t1(nt1, nt2, p, hit)
        lists = ((self.t1, ghost_of_t1), (self.t2, _T2)) if from_t1 else ((self.t2, _T2), (self.t1, _T1))
        for lst, ghost in lists:
            for e in lst:
                if not blocked(e):
                    return e, ghost, trim1, trim2
        return None, 0, False, False

    @staticmethod
    def _replace_t1(nt1: int, nt2: int, p: float, hit: int) -> bool:
        """ARC's REPLACE: whether the victim comes from T1 (else T2)."""
        return (nt1 > 0 and (nt1 > p or (nt1 == p and hit == _T2))) or nt2 == 0


__all__ = ["ARC"]
