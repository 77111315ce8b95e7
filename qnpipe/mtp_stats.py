"""What MTP speculation did: acceptance, its histogram, and where the time went (msgspec, in
qnpipe.stats.GenerateStats; below the live engine, which fills it)."""

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
    mean_accept_len: float = 0.0  # derived (`build`): tokens / rounds
    accept_rate_at: tuple[float, ...] = ()  # derived: accepted_at / drafted_at

    @classmethod
    def build(cls, **counts: object) -> SpecStats:
        """The stats of `counts` (the fields above the derived ones) with the derived fields filled in."""
        s = cls(**counts)  # pyright: ignore[reportArgumentType]
        return msgspec.structs.replace(
            s, mean_accept_len=s.tokens / s.rounds if s.rounds else 0.0,
            accept_rate_at=tuple(a / d if d else 0.0 for a, d in zip(s.accepted_at, s.drafted_at, strict=True)))

    def add(self, o: SpecStats) -> SpecStats:
        return SpecStats.build(
            rounds=self.rounds + o.rounds, tokens=self.tokens + o.tokens,
            accept_hist=_vadd(self.accept_hist, o.accept_hist), drafted_at=_vadd(self.drafted_at, o.drafted_at),
            accepted_at=_vadd(self.accepted_at, o.accepted_at), topk_hits=_vadd(self.topk_hits, o.topk_hits),
            rescues=self.rescues + o.rescues,
            capacity_split_verifies=self.capacity_split_verifies + o.capacity_split_verifies,
            draft_s=self.draft_s + o.draft_s, verify_s=self.verify_s + o.verify_s,
            rollback_s=self.rollback_s + o.rollback_s)

    def line(self) -> str:
        """One line for --stats."""
        rates = " ".join(f"{r:.2f}" for r in self.accept_rate_at)
        hist = " ".join(f"{a}:{n}" for a, n in enumerate(self.accept_hist))
        top = f"; drafter top-k holds the token {'/'.join(map(str, self.topk_hits))}" if self.topk_hits else ""
        return (f"[mtp: {self.rounds} rounds, {self.mean_accept_len:.2f} tokens per round; acceptance by position "
                f"{rates}; accepted drafts {hist}; {self.capacity_split_verifies} verify steps in parts; "
                f"draft {self.draft_s:.3f}s verify {self.verify_s:.3f}s rollback {self.rollback_s:.3f}s{top}]")

def _vadd(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
