"""The predictor actor's decisions, sans I/O: a step's gate candidates in, one ranked prefetch hint out.

Not imported by qnpipe.policy's __init__: qnpipe.messages imports the policy package.
"""

from __future__ import annotations

import attrs

from qnpipe.config import PredictCfg
from qnpipe.messages import Candidates, PrefetchHint
from qnpipe.policy.predict import rank


@attrs.define
class PredictorStats:
    candidates: int = 0
    hints: int = 0
    hints_dropped_full: int = 0  # the pool's inbox was full
    experts_hinted: int = 0


@attrs.define
class Hinter:
    """The predictor actor's decisions, sans I/O: one `Candidates` in, at most one `PrefetchHint` out."""

    predict_cfg: PredictCfg
    top: int
    stats: PredictorStats = attrs.field(factory=PredictorStats)
    seq: int = 0

    def hint(self, c: Candidates, now: float) -> PrefetchHint | None:
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

    def sent(self, hint: PrefetchHint | None) -> None:
        """`hint` reached the pool (None: the pool's inbox was full, it was dropped)."""
        if hint is None:
            self.stats.hints_dropped_full += 1
        else:
            self.stats.hints += 1
            self.stats.experts_hinted += len(hint.experts)


__all__ = ["Hinter", "PredictorStats"]
