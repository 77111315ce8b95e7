"""The predictor actor's decisions, sans I/O: a step's gate candidates in, one ranked prefetch hint out.

A hint is advisory: when the pool's inbox has no room it is dropped and counted, so prediction
never holds up the pipeline. The driver says how much room there is (`room`) before a turn;
the actor driver reads it off the channel, the heap driver off its inbox lists.

Not imported by qnpipe.policy's __init__: qnpipe.messages imports the policy package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import assert_never

import attrs

from qnpipe.config import PredictCfg
from qnpipe.messages import Candidates, PrefetchHint
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.predict import rank


@attrs.define
class PredictorStats:
    candidates: int = 0
    hints: int = 0
    hints_dropped_full: int = 0  # the pool's inbox was full
    experts_hinted: int = 0


@attrs.frozen(kw_only=True)
class PredictorStatistics:
    """The predictor's counters at one moment (zero when prediction is off)."""

    candidates: int
    hints: int
    hints_dropped_full: int  # the pool's inbox was full
    experts_hinted: int


@attrs.define
class Hinter:
    """The predictor actor's decisions, sans I/O: one `Candidates` in, at most one `PrefetchHint` out."""

    predict_cfg: PredictCfg
    top: int
    stats: PredictorStats = attrs.field(factory=PredictorStats)
    seq: int = 0
    room: int = 1 << 30  # hints the pool's inbox takes now: set by the driver before each turn

    def statistics(self) -> PredictorStatistics:
        return PredictorStatistics(**attrs.asdict(self.stats))

    def handle(self, msg: Candidates, now: float) -> Outbox:
        out = Outbox()
        self._handle(msg, now, out)
        return out

    def turn(self, msgs: Iterable[Candidates], now: float) -> Outbox:
        """A whole turn: `handle` of each of `msgs` in order (`end_turn` sends nothing), as one `Outbox`."""
        out = Outbox()
        for msg in msgs:
            self._handle(msg, now, out)
        return out

    def _handle(self, msg: Candidates, now: float, out: Outbox) -> None:
        match msg:
            case Candidates():
                hint = self._hint(msg, now)
                if hint is None:
                    pass
                elif self.room > 0:
                    self.room -= 1
                    self.stats.hints += 1
                    self.stats.experts_hinted += len(hint.experts)
                    out.pool.append(hint)
                else:
                    self.stats.hints_dropped_full += 1
            case _:
                assert_never(msg)

    def end_turn(self, now: float) -> Outbox:
        return Outbox()

    def _hint(self, c: Candidates, now: float) -> PrefetchHint | None:
        self.stats.candidates += 1
        predict_cfg = self.predict_cfg
        ranked = rank(c.token_experts, c.token_scores, c.width, agg=predict_cfg.aggregate,
                      union_k=predict_cfg.union_k, top=self.top, min_score=predict_cfg.min_score)
        if not ranked:
            return None
        self.seq += 1
        return PrefetchHint(t=now, seq=self.seq, step=c.step, source=c.layer, layer=c.target,
                            experts=tuple(e for e, _ in ranked), scores=tuple(s for _, s in ranked),
                            deadline=c.deadline)


__all__ = ["Hinter", "PredictorStatistics", "PredictorStats"]
