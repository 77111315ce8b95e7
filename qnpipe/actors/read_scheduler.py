"""The read scheduler: the one queue over the device.

The trio shell of `ReadCore` (qnpipe.policy.read_core), which owns the `ReadQueue`:
requests are merged when duplicate, ordered by class, and put on the device as the
in-flight budget allows, a batch at a time; each finished batch goes back to the pool as
one `ReadsDone` (the event log gets a `ReadDone` per read). A failed read (`ReadError`)
ends the actor with that error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.io.device import ExpertDevice, submit
from qnpipe.messages import Msg, PoolInbox, ReadInbox, ReadsDone
from qnpipe.policy.outbox import Batch, Outbox
from qnpipe.policy.read_core import BatchDone, ReadCore, ReadSchedulerStats
from qnpipe.policy.read_queue import ReadQueue
from qnpipe.policy.turn_order import READS, READS_DONE


async def read_scheduler(
    inbox: trio.MemoryReceiveChannel[ReadInbox],
    to_pool: trio.MemorySendChannel[PoolInbox],
    *,
    device: ExpertDevice,
    queue: ReadQueue,
    stats: ReadSchedulerStats,
    emit: Callable[[Msg], None] | None = None,
    turns: Turnstile | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve read requests until `inbox` closes and every read in flight has finished.

    `turns`: replay's turnstile (qnpipe.actors.turns), None live."""
    core = ReadCore(queue, stats, logging=emit is not None)

    async with inbox, to_pool, trio.open_nursery() as nursery:

        async def deliver(out: Outbox) -> None:
            if emit is not None:
                for r in out.log:
                    emit(r)
            for m in out.pool:
                if isinstance(m, ReadsDone):
                    await send_soon(to_pool, m)  # the channel's bound is proven (actors.pipeline)
                    continue
                try:  # an expired prefetch: bounded like ReadsDone, one message per outstanding read
                    to_pool.send_nowait(m)
                except trio.WouldBlock:
                    nursery.start_soon(to_pool.send, m)
            for b in out.batches:
                # Submitted in this turn: the I/O starts now, the task only waits for it.
                nursery.start_soon(run, b, submit(device, b.jobs))

        async def run(batch: Batch, reading: Awaitable[list[int]]) -> None:
            nbytes = await reading
            if turns is not None:
                await turns.turn(READS_DONE, batch.number)
            now = trio.current_time()
            await deliver(core.turn((BatchDone(batch, nbytes),), now))

        task_status.started()
        async for first in inbox:
            if turns is not None:
                await turns.turn(READS)
            # Take everything already waiting, so one step's misses are one batch on the device.
            await deliver(core.turn(drain(inbox, first), trio.current_time()))


__all__ = ["ReadSchedulerStats", "read_scheduler"]
