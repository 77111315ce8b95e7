"""Grants in progress: pending (reads on the way), held (complete) and deferred (waiting for slots).

`Grants` is the book the pool policy (qnpipe.policy.pool) keeps of them; the slot tables decide
where experts go, this decides which grant a finished read completes.
"""

from __future__ import annotations

import attrs

GrantKey = tuple[int, int, int]  # (step, layer, part)
Landed = tuple[GrantKey, int, int]  # (key, expert, slot): read, grant not complete


@attrs.frozen(slots=True)
class Deferred:
    """An acquire accepted but waiting for slots still loading (`PoolPolicy.deferred`). Its experts keep their
    room from acquires made later; `side` are those it found in the side region, held there while it waits so
    that they stay in memory (leaving, they would need resident slots it was not accepted with)."""

    experts: tuple[int, ...]
    asked: float
    side: tuple[int, ...]


@attrs.define(slots=True)
class Grant:
    """A grant being assembled or held: `slots[i]` holds `experts[i]`."""

    key: GrantKey
    experts: tuple[int, ...]
    slots: list[int]
    generations: list[int]
    missing: set[int]  # experts whose read is not done yet
    hits: int
    misses: int
    asked_t: float
    side: frozenset[int] = frozenset()  # experts served from the side region


@attrs.define
class Grants:
    pending: dict[GrantKey, Grant] = attrs.field(factory=dict)
    held: dict[GrantKey, Grant] = attrs.field(factory=dict)
    waiters: dict[tuple[int, int], list[GrantKey]] = attrs.field(factory=dict)  # (layer, expert) -> grants
    deferred: dict[GrantKey, Deferred] = attrs.field(factory=dict)  # in the order they were accepted

    def known(self, key: GrantKey) -> bool:
        return key in self.pending or key in self.held or key in self.deferred

    def waited_for(self, layer: int, expert: int) -> bool:
        """A grant waits for the read of (`layer`, `expert`)."""
        return (layer, expert) in self.waiters

    def reserved(self, layer: int, before: GrantKey | None = None) -> set[int]:
        """Experts of the acquires deferred at `layer` (those deferred before `before`, when it is one)."""
        out: set[int] = set()
        for k, d in self.deferred.items():
            if k == before:
                break
            if k[1] == layer:
                out.update(d.experts)
        return out

    def open(self, grant: Grant) -> Grant | None:
        """Keep `grant`: held when complete (and returned), else pending on the reads of its missing experts."""
        for e in grant.missing:
            self.waiters.setdefault((grant.key[1], e), []).append(grant.key)
        if grant.missing:
            self.pending[grant.key] = grant
            return None
        self.held[grant.key] = grant
        return grant

    def read_done(self, layer: int, expert: int) -> tuple[list[Grant], list[Landed]]:
        """The read of (`layer`, `expert`) finished: the grants it completes and, for those still waiting on
        others, (key, expert, slot) of what landed."""
        keys = self.waiters.pop((layer, expert), None)
        if keys is None:  # a prefetch no step waits for yet (most reads, with prediction on)
            return [], []
        done: list[Grant] = []
        landed: list[Landed] = []
        for key in keys:
            g = self.pending.get(key)
            if g is None:  # released (cancelled) before it was complete
                continue
            g.missing.discard(expert)
            if not g.missing:
                del self.pending[key]
                self.held[key] = g
                done.append(g)
            else:
                landed.append((key, expert, g.slots[g.experts.index(expert)]))
        return done, landed

    def present(self, key: GrantKey) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(experts, slots) of grant `key` already in memory while the rest is read; () when the
        grant is complete, deferred or has nothing in memory yet. The grant holds them already."""
        g = self.pending.get(key)
        if g is None:
            return (), ()
        pairs = [(e, s) for e, s in zip(g.experts, g.slots, strict=True) if e not in g.missing]
        return tuple(e for e, _ in pairs), tuple(s for _, s in pairs)


__all__ = ["Deferred", "Grant", "GrantKey", "Grants", "Landed"]
