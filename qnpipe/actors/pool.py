"""The pool actor: answers `Acquire` with slots once the experts are in memory.

The trio shell of `PoolCore` (qnpipe.policy.pool_core), which owns the decisions over the
slot tables (qnpipe.policy.pool.PoolPolicy): each turn takes every message already
waiting, sorted by (t, sender, seq) (qnpipe.policy.turn_order), hands each to the core and
sends what it returns: `Present` / `Granted` to the forward, `ReadExperts` / `Promote` to
the read scheduler (the event log gets a `ReadExpert` per read). The slot memory itself
is the forward's (qnpipe.model.slots); this actor only decides what goes where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.messages import ForwardDone, ForwardInbox, Msg, PoolInbox, ReadInbox
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pool import PoolPolicy
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.slot_table import Load
from qnpipe.policy.turn_order import POOL, in_turn_order


async def pool(
    inbox: trio.MemoryReceiveChannel[PoolInbox],
    to_reads: trio.MemorySendChannel[ReadInbox],
    to_forward: trio.MemorySendChannel[ForwardInbox],
    *,
    policy: PoolPolicy,
    preload: Sequence[tuple[int, Load]] = (),
    after_forward: Callable[[], None] | None = None,
    emit: Callable[[Msg], None] | None = None,
    turns: Turnstile | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails.

    `preload`: (layer, load) reads issued before anything else (autopin's pinned experts,
    already placed in `policy`); `after_forward` runs after each ForwardDone (autopin's saves);
    `turns`: replay's turnstile (qnpipe.actors.turns), None live.
    """
    core = PoolCore(policy, logging=emit is not None)

    async def deliver(out: Outbox) -> None:
        if emit is not None:
            for r in out.log:
                emit(r)
        for m in out.reads:
            await send_soon(to_reads, m)
        for f in out.forward:
            await send_soon(to_forward, f)

    async with inbox, to_reads, to_forward:
        await deliver(core.preload(preload, trio.current_time()))
        task_status.started()
        async for first in inbox:
            if turns is not None:
                await turns.turn(POOL)
            # Whatever else is already waiting is handled in the same turn: one wake-up, not one per message.
            now = trio.current_time()
            msgs = in_turn_order(list(drain(inbox, first)))
            if after_forward is None:  # the turn's answers in one (sent in the same order)
                await deliver(core.turn(msgs, now))
                continue
            for msg in msgs:
                out = core.handle(msg, now)
                if isinstance(msg, ForwardDone):
                    after_forward()
                await deliver(out)
            await deliver(core.end_turn(now))
