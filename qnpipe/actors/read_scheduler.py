"""The read scheduler: the one queue over the device.

Owns a `ReadQueue` (qnpipe.policy.read_queue): requests are merged when duplicate,
ordered by class, and put on the device as the in-flight budget allows, a batch at a
time; each finished batch goes back to the pool as one `ReadsDone` (the event log gets a
`ReadDone` per read). A failed read (`ReadError`) ends the actor with that error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from qnpipe.actors.stamp import Stamper, drain, send_soon
from qnpipe.io.device import ExpertDevice, submit
from qnpipe.messages import Msg, PoolInbox, Promote, ReadDone, ReadExpired, ReadInbox, ReadsDone
from qnpipe.policy.read_queue import Job, ReadQueue
from qnpipe.trace import ReadStarted


@attrs.define
class ReadSchedulerStats:
    """Counters of the read scheduler (device time sums batch wall times, which may overlap)."""

    requests: int = 0
    merged: int = 0
    batches: int = 0
    reads: int = 0
    bytes_read: int = 0
    device_s: float = 0.0
    peak_in_flight: int = 0
    promoted: int = 0  # queued prefetches turned into demand reads
    expired: int = 0  # prefetches not started: their deadline had passed


async def read_scheduler(
    inbox: trio.MemoryReceiveChannel[ReadInbox],
    to_pool: trio.MemorySendChannel[PoolInbox],
    *,
    device: ExpertDevice,
    queue: ReadQueue,
    stats: ReadSchedulerStats,
    emit: Callable[[Msg], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve read requests until `inbox` closes and every read in flight has finished."""
    st = Stamper()
    issued: dict[tuple[int, int], float] = {}

    async def run(jobs: Sequence[Job], started: float, reading: Awaitable[list[int]]) -> None:
        nbytes = await reading
        stats.batches += 1
        stats.device_s += trio.current_time() - started
        for job, n in zip(jobs, nbytes, strict=True):
            queue.done(job)
            stats.reads += 1
            stats.bytes_read += n
        asked = tuple(issued.pop(job.key) for job in jobs)
        done = ReadsDone(**st.stamp(), layers=tuple(j.layer for j in jobs), experts=tuple(j.expert for j in jobs),
                         slots=tuple(j.slot for j in jobs), nbytes=tuple(nbytes), issued_t=asked, started_t=started)
        if emit is not None:
            for job, n, t in zip(jobs, nbytes, asked, strict=True):
                emit(ReadDone(**st.stamp(), layer=job.layer, expert=job.expert, slot=job.slot, nbytes=n,
                              issued_t=t, started_t=started))
        await send_soon(to_pool, done)  # the channel's bound is proven (engine.open_pipeline)
        dispatch()

    async with inbox, to_pool, trio.open_nursery() as nursery:

        def dispatch() -> None:
            now = trio.current_time()
            while jobs := queue.take(now):
                stats.peak_in_flight = max(stats.peak_in_flight, queue.peak_in_flight)
                if emit is not None:
                    for job in jobs:
                        emit(ReadStarted(**st.stamp(), layer=job.layer, expert=job.expert, slot=job.slot))
                # Submitted in this turn: the I/O starts now, the task only waits for it.
                nursery.start_soon(run, jobs, now, submit(device, jobs))
            for job in queue.pop_expired():
                stats.expired += 1
                issued.pop(job.key, None)
                msg = ReadExpired(**st.stamp(), layer=job.layer, expert=job.expert, slot=job.slot)
                try:  # bounded like ReadDone: one message per outstanding read
                    to_pool.send_nowait(msg)
                except trio.WouldBlock:
                    nursery.start_soon(to_pool.send, msg)

        task_status.started()
        async for first in inbox:
            # Take everything already waiting, so one step's misses are one batch on the device.
            for msg in drain(inbox, first):
                if isinstance(msg, Promote):
                    stats.promoted += queue.promote((msg.layer, msg.expert))
                    continue
                scores = msg.scores or (0.0,) * len(msg.experts)
                for expert, slot, score in zip(msg.experts, msg.slots, scores, strict=True):
                    stats.requests += 1
                    job = Job(msg.layer, expert, slot, msg.cls, msg.deadline, score)
                    if queue.push(job):
                        issued[job.key] = msg.t
                    else:
                        stats.merged += 1
            dispatch()
