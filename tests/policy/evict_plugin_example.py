"""LRU-2 (O'Neil et al., SIGMOD '93) as a plug-in eviction policy: the example of docs/pool.md.

    pool.evict_policy = "evict_plugin_example:LRU2"    # with this file's directory on sys.path
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class LRU2:
    """Evicts the expert whose second-to-last access is the oldest; one used once goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # slots of the layer (unused here)
        self.ticks: dict[int, tuple[int, int]] = {}  # expert -> (second-to-last tick or -1, last tick)

    def inserted(self, expert: int, tick: int) -> None:
        self.ticks[expert] = (-1, tick)

    def accessed(self, expert: int, tick: int) -> None:
        self.ticks[expert] = (self.ticks[expert][1], tick)

    def removed(self, expert: int) -> None:
        del self.ticks[expert]

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        return min(candidates, key=self.ticks.__getitem__)  # last ticks are unique: so are the keys

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        free = [e for e in self.ticks if e not in loading and e not in held and e not in pinned]
        return self.victim(free, incoming) if free else None

    def forward_done(self) -> None:
        pass
