"""The predictor actor: ranks the forward's gate candidates into prefetch hints for the pool.

Everything it sends is advisory: when the pool's inbox is full the hint is dropped and
counted, so prediction can never hold up the forward. Ranking: qnpipe.policy.predict.rank.
"""

from __future__ import annotations

import attrs
import trio

from qnpipe.actors.stamp import Stamper, drain
from qnpipe.config import PredictCfg
from qnpipe.messages import Candidates, PoolInbox, PrefetchHint
from qnpipe.policy.predict import rank


@attrs.define
class PredictorStats:
    candidates: int = 0
    hints: int = 0
    hints_dropped_full: int = 0  # the pool's inbox was full
    experts_hinted: int = 0


async def predictor(
    inbox: trio.MemoryReceiveChannel[Candidates],
    to_pool: trio.MemorySendChannel[PoolInbox],
    *,
    predict_cfg: PredictCfg,
    top: int,
    stats: PredictorStats,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Turn each `Candidates` into one `PrefetchHint` of at most `top` experts, until `inbox` closes."""
    st = Stamper()
    async with inbox, to_pool:
        task_status.started()
        async for first in inbox:
            for c in drain(inbox, first):
                stats.candidates += 1
                ranked = rank(c.token_experts, c.token_scores, c.width, agg=predict_cfg.aggregate,
                              union_k=predict_cfg.union_k, top=top, min_score=predict_cfg.min_score)
                if not ranked:
                    continue
                hint = PrefetchHint(**st.stamp(), step=c.step, source=c.layer, layer=c.target,
                                    experts=tuple(e for e, _ in ranked), scores=tuple(s for _, s in ranked),
                                    deadline=c.deadline)
                try:
                    to_pool.send_nowait(hint)
                except trio.WouldBlock:
                    stats.hints_dropped_full += 1
                    continue
                stats.hints += 1
                stats.experts_hinted += len(ranked)
