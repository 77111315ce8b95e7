"""The interface of an eviction policy, on its own so the policies (qnpipe.policy.eviction) and the
plug-in loader and checker (qnpipe.policy.eviction_plugin, plugin_check) all import it from below."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol


class Eviction(Protocol):
    """The interface of one layer's eviction policy, built-in or plug-in (docs/pool.md, "Plug-in policies").

    The slot table calls, for each step that uses the layer: `accessed` for every expert it
    finds in the pool, then for each miss either `inserted` (a free slot) or `pick`, then
    `removed` of the expert `pick` named, then `inserted`. `pick` is only asked when every
    slot holds an expert, so the policy has been told of `capacity` residents then.
    """

    def inserted(self, expert: int, tick: int) -> None:
        """`expert` was given a slot at `tick` (counts as its first access)."""
        ...

    def accessed(self, expert: int, tick: int) -> None:
        """A step used resident `expert` at `tick`."""
        ...

    def removed(self, expert: int) -> None:
        """`expert` left the pool (evicted: `pick` named it just before; else its read was cancelled)."""
        ...

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        """The candidate `pick` would evict if only `candidates` were evictable (never empty), for
        `incoming`; changes nothing. The reference `pick` is tested against."""
        ...

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        """The resident expert to evict so that `incoming` (not resident) gets its slot: none of
        `loading`, `held`, `pinned` (None: every one is blocked). The table evicts it."""
        ...

    def forward_done(self) -> None:
        """One forward step of the model finished (LFU decay counts these)."""
        ...
