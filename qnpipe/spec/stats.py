"""What speculation did: acceptance, its histogram, and where the time went (msgspec, in GenerateStats)."""

from __future__ import annotations

import msgspec


class SpecStats(msgspec.Struct, frozen=True, kw_only=True):
    """MTP speculation of one or more generate calls.

    `accept_hist[a]`: rounds that accepted `a` drafts; `drafted_at[i]` / `accepted_at[i]`:
    drafts made / accepted at draft position i (0 = first). `mean_accept_len`: tokens
    committed per round (accepted drafts + the model's own token). `topk_hits[i]`
    (`diag.accept_topk` > 0): rounds where the main model's token at position i was in the
    drafter's top-k. `capacity_split_verifies`: verify steps at least one layer of which
    needed more than one part (the pool's capacity-floor path).
    """

    rounds: int = 0
    tokens: int = 0
    accept_hist: tuple[int, ...] = ()
    drafted_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    topk_hits: tuple[int, ...] = ()
    rescues: int = 0  # top-2 / tree branches that were accepted instead of the first choice
    capacity_split_verifies: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0

    @property
    def mean_accept_len(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def accept_rate_at(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True))

    def add(self, o: SpecStats) -> SpecStats:
        return SpecStats(
            rounds=self.rounds + o.rounds, tokens=self.tokens + o.tokens,
            accept_hist=_vadd(self.accept_hist, o.accept_hist), drafted_at=_vadd(self.drafted_at, o.drafted_at),
            accepted_at=_vadd(self.accepted_at, o.accepted_at), topk_hits=_vadd(self.topk_hits, o.topk_hits),
            rescues=self.rescues + o.rescues,
            capacity_split_verifies=self.capacity_split_verifies + o.capacity_split_verifies,
            draft_s=self.draft_s + o.draft_s, verify_s=self.verify_s + o.verify_s,
            rollback_s=self.rollback_s + o.rollback_s)

    def summary(self) -> dict[str, object]:
        """The stats plus the derived rates (what --stats prints)."""
        return {**msgspec.structs.asdict(self), "mean_accept_len": self.mean_accept_len,
                "accept_rate_at": list(self.accept_rate_at)}


def _vadd(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
