"""The pool actor: answers `Acquire` with slots once the experts are in memory.

Owns the slot tables (qnpipe.policy.pool.PoolPolicy). Misses become `ReadExpert`
commands to the read scheduler; its `ReadDone`s complete grants. The slot memory itself
is the forward's (qnpipe.model.slots); this actor only decides what goes where.
"""

from __future__ import annotations

import trio

from qnpipe.actors.stamp import Stamper
from qnpipe.messages import Acquire, ForwardDone, Granted, PoolInbox, ReadDone, ReadExpert, Release
from qnpipe.policy.pool import Grant, PoolPolicy


async def pool(
    inbox: trio.MemoryReceiveChannel[PoolInbox],
    to_reads: trio.MemorySendChannel[ReadExpert],
    to_forward: trio.MemorySendChannel[Granted],
    *,
    policy: PoolPolicy,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails."""
    st = Stamper()

    async def grant(g: Grant) -> None:
        step, layer, part = g.key
        now = trio.current_time()
        await to_forward.send(Granted(**st.stamp(), step=step, layer=layer, part=part, experts=g.experts,
                                      slots=tuple(g.slots), generations=tuple(g.generations), hits=g.hits,
                                      misses=g.misses, waited_s=now - g.asked_t))

    async with inbox, to_reads, to_forward:
        task_status.started()
        async for msg in inbox:
            match msg:
                case Acquire(step=step, layer=layer, part=part, experts=experts):
                    loads, ready = policy.acquire((step, layer, part), experts, msg.t)
                    for ld in loads:
                        await to_reads.send(ReadExpert(**st.stamp(), layer=layer, expert=ld.expert, slot=ld.slot))
                    if ready is not None:
                        await grant(ready)
                case ReadDone(layer=layer, expert=expert, slot=slot):
                    for g in policy.read_done(layer, expert, slot):
                        await grant(g)
                case Release(step=step, layer=layer, part=part):
                    policy.release((step, layer, part), msg.token_experts, msg.token_slots)
                case ForwardDone():
                    policy.forward_done()
