"""Slots across layers: the allocation of a total slot budget that maximises the curves' summed hits (pure).

A max-plus knapsack over the layers: after layer i, `best[s]` is the most hits layers 0..i can have
with s slots in all, each layer between top-k and its expert count. Exact for any curves, concave or
not (LRU's curve need not be: qnpipe.replay.mrc), so the allocation is never below uniform's at the
same slots on the curves it was given (tests/plan/test_allocate.py checks it against brute force).
One pass gives every total up to `max_total`: a sweep of budgets costs one allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_NEG = np.iinfo(np.int64).min // 4


class Allocator:
    """`hits[i][c - lo]` = layer i's hits at c slots, c in lo..lo + len - 1; totals up to `max_total`."""

    def __init__(self, hits: Sequence[Sequence[int]], lo: int, max_total: int) -> None:
        self.n = len(hits)
        self.lo = lo
        # Each curve up to its first maximum: a slot past it never gains, so the fewest-slot optimum never
        # takes it, and the table stays as wide as the slots that can matter (a short log of many layers
        # of 4096 experts would otherwise make it layers x experts wide, for each of every layer's points).
        self.curves = [c[:int(np.argmax(c)) + 1] if len(c) else c
                       for c in (np.asarray(h, dtype=np.int64) for h in hits)]
        top = sum(lo + len(h) - 1 for h in self.curves)
        self.max_total = min(max_total, top)
        size = self.max_total + 1
        best = np.full(size, _NEG, dtype=np.int64)
        best[0] = 0
        self.choice: list[np.ndarray] = []
        for h in self.curves:
            new = np.full(size, _NEG, dtype=np.int64)
            arg = np.zeros(size, dtype=np.int32)
            for j, gain in enumerate(h.tolist()):
                c = lo + j
                if c >= size:
                    break
                cand = best[:size - c] + gain
                better = cand > new[c:]  # strict: the fewest slots reaching the best keeps them
                new[c:][better] = cand[better]
                arg[c:][better] = c
            best = new
            self.choice.append(arg)
        self.best = best

    def hits(self, total: int) -> int:
        """The most hits with at most `total` slots (ValueError below top-k per layer)."""
        s = self._at(total)
        return int(self.best[s])

    def _at(self, total: int) -> int:
        if total < self.lo * self.n:
            raise ValueError(f"{total} slots: below {self.lo} per layer x {self.n} layers")
        s = min(total, self.max_total)
        return int(np.argmax(self.best[:s + 1] == self.best[:s + 1].max()))  # the fewest slots at the best

    def caps(self, total: int) -> list[int]:
        """Each layer's slots at the best allocation of at most `total` slots."""
        s = self._at(total)
        out = [0] * self.n
        for i in range(self.n - 1, -1, -1):
            c = int(self.choice[i][s])
            out[i] = c
            s -= c
        return out


def uniform_caps(n: int, total: int, lo: int, hi: int) -> list[int]:
    """`total` slots as even as possible over `n` layers (the first layers take the remainder), in lo..hi."""
    base, extra = divmod(total, n)
    return [max(lo, min(hi, base + (i < extra))) for i in range(n)]


def curve_hits(hits: Sequence[Sequence[int]], lo: int, caps: Sequence[int]) -> int:
    return sum(int(h[c - lo]) for h, c in zip(hits, caps, strict=True))


__all__ = ["Allocator", "curve_hits", "uniform_caps"]
