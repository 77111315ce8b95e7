"""LFU's miss-ratio curve: the pool's LFU replayed at a grid of capacities, interpolated between (pure).

Not one pass: the pool's LFU is not a stack algorithm. Its counts do not depend on the capacity (every
access counts, hit or load, and counts persist out of the pool), but its ties go to the least recent,
and within a layer-step the pool touches the hits before it loads the misses, so the recency of a
step's experts, and with it which of two equal counts goes, depends on which were hits at that
capacity (the reason the pool's LRU loses the inclusion property, qnpipe.replay.mrc). Counts halved
every `pool.lfu_decay_interval_forwards` forwards make ties common. So each grid capacity is replayed as
the pool's own slot table runs LFU (`lfu_hits`: qnpipe.policy.slot_table with qnpipe.policy.eviction.LFU,
parts below a step's union as the pool runs them; `lfu_hits_fast`, the curves' own, the same keys and
victims on a heap, held equal to it), exact there (tests/replay/test_mrc_lfu.py holds it to `qnpipe
replay`), and the capacities between are linear interpolations of the two grid neighbours, rounded
down. A layer of at most `GRID` capacities is replayed at every one: its curve is exact everywhere.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from qnpipe.policy.eviction import LFU
from qnpipe.policy.parts import Splitter
from qnpipe.policy.slot_table import SlotTable
from qnpipe.replay.mrc import ALL, Curve, layer_requests
from qnpipe.trace import ModelShape

GRID = 17  # replays per layer: ~0.1 s each per 10k layer-steps on one core


def grid(lo: int, hi: int, points: int = GRID) -> list[int]:
    """`points` capacities from lo to hi, both ends in, evenly spaced (every one when there are fewer)."""
    if hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    return sorted({lo + round(i * (hi - lo) / (points - 1)) for i in range(points)})


def lfu_hits(steps: Sequence[tuple[int, ...] | None], k: int, capacity: int, *, decay_interval: int = 0,
             by_expert: bool = True) -> tuple[int, int]:
    """(hits, requests) of one layer's slot table under the pool's LFU at `capacity`: `steps[s]` = the
    layer's experts at step s (flat, token-major, `k` per token) or None (not routed; a forward all the same).
    `by_expert`: split steps in the forward's parts of forward.parts=experts (else token ranges)."""
    split = Splitter(by_expert)
    table = SlotTable(0, capacity, LFU(decay_interval=decay_interval))
    hits = requests = 0
    for experts in steps:
        if experts is not None:
            for _, _, part in split.parts(experts, k, capacity):
                plan = table.acquire(part)
                for ld in plan.loads:
                    table.loaded(ld.expert, ld.slot)
                table.release(part)
                hits += len(plan.hits)
                requests += len(part)
        table.forward_done()
    return hits, requests


def lfu_hits_fast(steps: Sequence[tuple[int, ...] | None], k: int, capacity: int, *, decay_interval: int = 0,
                  by_expert: bool = True) -> tuple[int, int]:
    """`lfu_hits` without the slot table: the same keys (count, then tick: LFU's packed int, as a pair), the
    same victim (the least key outside the part being acquired), a heap with stale entries skipped for the
    minimum. A few times faster; tests/replay/test_mrc_lfu.py holds the two equal."""
    count: dict[int, int] = {}
    key: dict[int, tuple[int, int]] = {}  # cached expert -> its key
    last: dict[int, int] = {}  # cached expert -> its tick
    heap: list[tuple[tuple[int, int], int]] = []
    tick = hits = requests = forwards = 0
    push, pop = heapq.heappush, heapq.heappop
    split = Splitter(by_expert)
    for experts in steps:
        if experts is not None:
            parts = ([tuple(sorted(experts))] if len(experts) == k
                     else [p for _, _, p in split.parts(experts, k, capacity)])
            for part in parts:
                requests += len(part)
                missing = []
                for e in part:
                    if e in key:
                        tick += 1
                        c = count[e] = count[e] + 1
                        last[e] = tick
                        kk = key[e] = (c, tick)
                        push(heap, (kk, e))
                        hits += 1
                    else:
                        missing.append(e)
                if not missing:
                    continue
                inside = set(part)
                for e in missing:
                    if len(key) >= capacity:
                        kept = []
                        while True:
                            kv, v = pop(heap)
                            if key.get(v) != kv:
                                continue  # stale: re-keyed or evicted since
                            if v in inside:
                                kept.append((kv, v))
                                continue
                            break
                        for x in kept:
                            push(heap, x)
                        del key[v], last[v]
                    tick += 1
                    c = count[e] = count.get(e, 0) + 1
                    last[e] = tick
                    kk = key[e] = (c, tick)
                    push(heap, (kk, e))
                if len(heap) > 4 * capacity + 64:  # drop the stale entries
                    heap = [(kk, e) for e, kk in key.items()]
                    heapq.heapify(heap)
        forwards += 1
        if decay_interval and forwards % decay_interval == 0:
            count = {e: c >> 1 for e, c in count.items() if c > 1 or e in last}
            key = {e: (count.get(e, 0), t) for e, t in last.items()}
            heap = [(kk, e) for e, kk in key.items()]
            heapq.heapify(heap)
    return hits, requests


def lfu_curves(steps: Sequence[Sequence[tuple[int, tuple[int, ...]]]], shape: ModelShape, *,
               decay_interval: int = 0, points: int = GRID, by_expert: bool = True) -> list[Curve]:
    """LFU's curve of every layer the log routes (capacities top-k..experts), and their total (`layer=ALL`);
    `by_expert` as `lfu_hits`'."""
    k, e_count = shape.top_k, shape.num_experts
    caps = list(range(k, e_count + 1))
    at = grid(k, e_count, points)
    per_layer = layer_requests(steps, shape.moe_layers)
    own: list[Curve] = []
    for layer in shape.moe_layers:
        if not per_layer[layer]:
            continue
        seq: list[tuple[int, ...] | None] = [None] * len(steps)
        for s, step in enumerate(steps):
            for ly, experts in step:
                if ly == layer:
                    seq[s] = tuple(experts)
        known = {c: lfu_hits_fast(seq, k, c, decay_interval=decay_interval, by_expert=by_expert) for c in at}
        hits = [_between(known, at, c, 0) for c in caps]
        reqs = [_between(known, at, c, 1) for c in caps]
        own.append(Curve(policy="lfu", layer=layer, capacities=caps, hits=hits, requests=reqs))
    own.append(Curve(policy="lfu", layer=ALL, capacities=caps,
                     hits=[sum(c.hits[i] for c in own) for i in range(len(caps))],
                     requests=[sum(c.requests[i] for c in own) for i in range(len(caps))]))
    return own


def _between(known: dict[int, tuple[int, int]], at: list[int], c: int, i: int) -> int:
    if c in known:
        return known[c][i]
    j = next(n for n, x in enumerate(at) if x > c)
    a, b = at[j - 1], at[j]
    va, vb = known[a][i], known[b][i]
    return va + (vb - va) * (c - a) // (b - a)


__all__ = ["GRID", "grid", "lfu_curves", "lfu_hits", "lfu_hits_fast"]
