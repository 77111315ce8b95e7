"""Autopin's decisions: routing heat per layer, and which experts to pin at start-up.

Heat is counted per layer-step: every expert one step routes to at one MoE layer counts
once, however many of the step's tokens chose it (a 512-token prefill chunk and one
decoded token weigh the same). That is what the pool sees (one `Acquire` per part of a
layer-step; parts of the same layer-step are deduplicated), so heat measures how often an
expert is needed in the pool, not how much work it does.

`autopin_plan` fills each layer with its hottest experts (count > 0; ties to the lower
id), at most `pin_budget(capacity, top_k, frac)` of them: floor(frac * capacity), clamped
so that capacity - pinned >= top_k, since a decode step needs top_k slots that are not
pinned to other experts. `PoolPolicy.preload` puts them in the pool pinned. Pure: the file
(qnpipe.io.heat_file) and the trio side (qnpipe.actors.autopin) live elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

Counts = dict[int, dict[int, int]]  # layer -> expert -> count


@attrs.define
class Heat:
    """Routing heat per layer, accumulated from `start` (loaded from an earlier run)."""

    counts: Counts = attrs.field(factory=dict)
    forwards: int = 0
    _last: dict[int, tuple[int, set[int]]] = attrs.field(factory=dict)  # layer -> (step, experts counted)

    def count(self, step: int, layer: int, experts: Iterable[int]) -> None:
        """One part of layer-step (`step`, `layer`) uses `experts`; each counts once per layer-step."""
        last = self._last.get(layer)
        if last is None or last[0] != step:
            last = self._last[layer] = (step, set())
        seen = last[1]
        row = self.counts.setdefault(layer, {})
        for e in experts:
            if e not in seen:
                seen.add(e)
                row[e] = row.get(e, 0) + 1

    def forward_done(self) -> None:
        self.forwards += 1

    def snapshot(self) -> Counts:
        """A copy of the counts (safe to hand to another thread)."""
        return {layer: dict(row) for layer, row in self.counts.items()}

    def hottest(self, layer: int, n: int) -> list[int]:
        """Up to `n` experts of `layer` with a count > 0, hottest first, ties to the lower id."""
        row = self.counts.get(layer, {})
        ranked = sorted((e for e, c in row.items() if c > 0), key=lambda e: (-row[e], e))
        return ranked[:max(n, 0)]


def pin_budget(capacity: int, top_k: int, frac: float) -> int:
    """Experts to pin in a layer of `capacity` slots: floor(frac * capacity), leaving at least top_k unpinned."""
    return max(0, min(math.floor(frac * capacity), capacity - top_k))


def autopin_plan(heat: Heat, capacities: Mapping[int, int], top_k: int, frac: float) -> dict[int, list[int]]:
    """layer -> the experts to pin there (only layers that get at least one)."""
    plan = {layer: heat.hottest(layer, pin_budget(cap, top_k, frac)) for layer, cap in capacities.items()}
    return {layer: experts for layer, experts in plan.items() if experts}
