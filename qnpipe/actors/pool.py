"""The pool actor: answers `Acquire` with slots once the experts are in memory.

Owns the slot tables (qnpipe.policy.pool.PoolPolicy). Misses become `ReadExpert`
commands to the read scheduler; its `ReadDone`s complete grants. The slot memory itself
is the forward's (qnpipe.model.slots); this actor only decides what goes where.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from qnpipe.actors.stamp import Stamper, drain
from qnpipe.messages import Acquire, ForwardDone, Granted, Msg, PoolInbox, ReadDone, ReadExpert, Release
from qnpipe.policy.pool import Grant, PoolPolicy
from qnpipe.policy.slot_table import Load
from qnpipe.trace import Evicted


async def pool(
    inbox: trio.MemoryReceiveChannel[PoolInbox],
    to_reads: trio.MemorySendChannel[ReadExpert],
    to_forward: trio.MemorySendChannel[Granted],
    *,
    policy: PoolPolicy,
    emit: Callable[[Msg], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails."""
    st = Stamper()

    async def grant(g: Grant) -> None:
        step, layer, part = g.key
        now = trio.current_time()
        msg = Granted(**st.stamp(), step=step, layer=layer, part=part, experts=g.experts, slots=tuple(g.slots),
                      generations=tuple(g.generations), hits=g.hits, misses=g.misses, waited_s=now - g.asked_t)
        if emit is not None:
            emit(msg)
        try:
            to_forward.send_nowait(msg)
        except trio.WouldBlock:
            await to_forward.send(msg)

    async def read(layer: int, loads: list[Load]) -> None:
        # All of a step's misses reach the scheduler before it runs, so they go out as one batch.
        for ld in loads:
            req = ReadExpert(**st.stamp(), layer=layer, expert=ld.expert, slot=ld.slot)
            if emit is not None:
                if ld.evicted >= 0:
                    emit(Evicted(t=req.t, seq=req.seq, layer=layer, expert=ld.evicted, slot=ld.slot,
                                 for_expert=ld.expert))
                emit(req)
            try:
                to_reads.send_nowait(req)
            except trio.WouldBlock:
                await to_reads.send(req)

    async def handle(msg: PoolInbox) -> None:
        if emit is not None:
            emit(msg)
        match msg:
            case Acquire(step=step, layer=layer, part=part, experts=experts):
                loads, ready = policy.acquire((step, layer, part), experts, msg.t)
                await read(layer, loads)
                if ready is not None:
                    await grant(ready)
            case ReadDone(layer=layer, expert=expert, slot=slot):
                loads, grants = policy.read_done(layer, expert, slot)
                await read(layer, loads)
                for g in grants:
                    await grant(g)
            case Release(step=step, layer=layer, part=part):
                policy.release((step, layer, part), msg.token_experts, msg.token_slots)
            case ForwardDone():
                policy.forward_done()

    async with inbox, to_reads, to_forward:
        task_status.started()
        async for first in inbox:
            # Whatever else is already waiting is handled in the same turn: one wake-up, not one per message.
            for msg in drain(inbox, first):
                await handle(msg)

