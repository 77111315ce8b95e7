"""Belady's optimal hit rate for demand caching of one layer's experts (pure: no trio, no I/O).

A layer sees a sequence of requests, each a set of distinct experts that must all be
resident together (one layer-step, or one part of it). With `capacity` slots, a request's
experts already resident are hits, the others misses; to make room the cache evicts,
among residents the request does not need, the one whose next use is farthest in the
future (never used again = farthest; ties to the higher expert id). No demand policy
can hit more often with the same capacity; `brute_force_hits` checks that on tiny inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

_NEVER = 1 << 62


def belady_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Hits of farthest-next-use eviction over `requests` (each of at most `capacity` distinct experts)."""
    reqs = [frozenset(r) for r in requests]
    for i, r in enumerate(reqs):
        if len(r) > capacity:
            raise ValueError(f"request {i} needs {len(r)} experts, above the capacity {capacity}")
    # next_use[i][e]: the first request after i that needs e (computed backwards).
    nxt: dict[int, int] = {}
    next_use: list[dict[int, int]] = [{} for _ in reqs]
    for i in range(len(reqs) - 1, -1, -1):
        next_use[i] = {e: nxt.get(e, _NEVER) for e in reqs[i]}
        for e in reqs[i]:
            nxt[e] = i
    cache: dict[int, int] = {}  # expert -> its next use
    # (-next use, -id) of every resident's current next use, and stale ones (an evicted expert, or
    # a next use that has passed): the heap's top that is still current is the farthest-next-use
    # resident, ties to the higher id.
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, r in enumerate(reqs):
        missing = [e for e in r if e not in cache]
        hits += len(r) - len(missing)
        over = len(cache) + len(missing) - capacity
        while over > 0:
            nu, ne = heapq.heappop(heap)
            e = -ne
            # The request's own residents have next use i, the nearest: never the farthest while
            # another is resident; skipped all the same, and pushed again below.
            if cache.get(e) != -nu or e in r:
                continue
            del cache[e]
            over -= 1
        uses = next_use[i]
        for e in r:
            u = cache[e] = uses[e]
            heapq.heappush(heap, (-u, -e))
    return hits


def brute_force_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The best hits over every eviction choice (exponential: tiny inputs only, for tests)."""
    from itertools import combinations

    reqs = [frozenset(r) for r in requests]
    best: dict[frozenset[int], int] = {frozenset(): 0}  # reachable caches -> best hits so far
    for r in reqs:
        out: dict[frozenset[int], int] = {}
        for cache, h in best.items():
            hit = len(r & cache)
            union = cache | r
            over = len(union) - capacity
            others = sorted(cache - r)
            choices = [frozenset(c) for c in combinations(others, over)] if over > 0 else [frozenset()]
            for drop in choices:
                nxt = union - drop
                if out.get(nxt, -1) < h + hit:
                    out[nxt] = h + hit
        best = out
    return max(best.values())


__all__ = ["belady_hits", "brute_force_hits"]
