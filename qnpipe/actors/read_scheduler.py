"""The read scheduler: the one queue over the device.

The trio shell of `ReadCore` (qnpipe.policy.read_core), which owns the `ReadQueue`:
requests are merged when duplicate, ordered by class, and put on the device as the
in-flight budget allows, a batch at a time; each finished batch goes back to the pool as
one `ReadsDone` (the event log gets a `ReadDone` per read). A failed read (`ReadError`)
ends the actor with that error.

A batch of demand reads on a device that can read on the calling thread (`read_now`, the
live `StoreDevice`) is read right here, blocking the loop, after one checkpoint: a step waits
for it, the checkpoint lets the forward start an early grant's hits first (their compute runs
on MLX's own threads meanwhile), and the thread hand-offs of a submitter thread (its wake-up to
start the batch and the loop's wake-up when it ends, ~130 and ~165 µs each on this VM,
docs/measurements.md) are not paid. Prefetch batches go to the submitter threads as before, so
speculation never blocks the loop; replay's devices have no `read_now`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.io.device import ExpertDevice, submit
from qnpipe.messages import Msg, PoolInbox, ReadClass, ReadInbox, ReadsDone
from qnpipe.policy.outbox import Batch, Outbox
from qnpipe.policy.read_core import BatchDone, ReadCore, ReadSchedulerStats
from qnpipe.policy.read_queue import Job, ReadQueue
from qnpipe.policy.turn_order import READS, READS_DONE

INLINE_DEMAND = True  # False: every batch through the submitter threads (the A/B reference)


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
    read_now: Callable[[list[Job]], list[int]] | None = getattr(device, "read_now", None) if INLINE_DEMAND else None
    if turns is not None:
        read_now = None  # replay's turn order needs every completion to take its own turn
    inline: list[Batch] = []

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
                if read_now is not None and b.jobs[0].cls is ReadClass.DEMAND:  # a batch is of one class
                    inline.append(b)
                    continue
                # Submitted in this turn: the I/O starts now, the task only waits for it.
                nursery.start_soon(run, b, submit(device, b.jobs))
            while inline:
                b = inline.pop(0)
                await trio.lowlevel.checkpoint()  # the forward starts an early grant's hits first
                assert read_now is not None
                nbytes = read_now(b.jobs)
                await deliver(core.turn((BatchDone(b, nbytes),), trio.current_time()))

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
