"""The predictor actor: ranks the forward's gate candidates into prefetch hints for the pool.

The trio shell of `Hinter` (qnpipe.policy.hinter). Everything it sends is advisory: when
the pool's inbox is full the hint is dropped and counted, so prediction can never hold up
the forward.
"""

from __future__ import annotations

import trio

from qnpipe.actors.stamp import drain
from qnpipe.actors.turns import Turnstile
from qnpipe.config import PredictCfg
from qnpipe.messages import Candidates, PoolInbox
from qnpipe.policy.hinter import Hinter, PredictorStats
from qnpipe.policy.turn_order import PREDICTOR


async def predictor(
    inbox: trio.MemoryReceiveChannel[Candidates],
    to_pool: trio.MemorySendChannel[PoolInbox],
    *,
    predict_cfg: PredictCfg,
    top: int,
    stats: PredictorStats,
    turns: Turnstile | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Turn each `Candidates` into one `PrefetchHint` of at most `top` experts, until `inbox` closes."""
    core = Hinter(predict_cfg, top, stats)
    async with inbox, to_pool:
        task_status.started()
        async for first in inbox:
            if turns is not None:
                await turns.turn(PREDICTOR)
            now = trio.current_time()
            st = to_pool.statistics()  # send_nowait's rule: the free buffer, or a receiver waiting
            core.room = int(min(st.max_buffer_size - st.current_buffer_used + st.tasks_waiting_receive, 1 << 30))
            for c in drain(inbox, first):
                for hint in core.handle(c, now).pool:
                    to_pool.send_nowait(hint)  # no await since `room` was read: it fits


__all__ = ["PredictorStats", "predictor"]
