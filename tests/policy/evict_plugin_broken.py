"""Plug-ins that do not satisfy the Eviction protocol (tests/policy/test_evict_plugin.py)."""

from __future__ import annotations

from evict_plugin_example import LRU2

NOT_A_CLASS = 3


class NoPick:
    def __init__(self, capacity: int) -> None:
        pass

    def inserted(self, expert: int, tick: int) -> None: ...
    def accessed(self, expert: int, tick: int) -> None: ...
    def removed(self, expert: int) -> None: ...
    def victim(self, candidates: object, incoming: int) -> int: return 0
    def forward_done(self) -> None: ...


class OldPick(LRU2):
    """The protocol before `incoming`: pick(loading, held, pinned)."""

    def pick(self, loading: object, held: object, pinned: object) -> int | None:  # type: ignore[override]
        return None


class NoCapacity(LRU2):
    def __init__(self) -> None:  # called as NoCapacity(capacity=N): a TypeError
        super().__init__(0)
