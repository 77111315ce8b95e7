"""A simulated SSD: an `ExpertDevice` whose reads take modelled time on the trio clock (replay).

The trio shell of `DeviceModel` (qnpipe.io.sim_model, the service model itself): `submit`
hands a batch to the model at once (in the read scheduler's turn, so batches reach the
device in the order they were formed), and one task wakes when the model has something due
and sets the finished batches' events in completion order, one per checkpoint (style §6.2,
the SimPy design; a task per read would complete same-time reads in a random order, §6.1).
Nothing touches memory: the slots of a replay hold no data. No threads (§6.3): run it under
`MockClock`.

    async with open_simssd(profile, record_nbytes) as dev:
        ...  # dev.read(jobs) from any task
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager

import trio

from qnpipe.io.sim_model import PROFILES, DeviceModel, DeviceProfile, SimStatistics, SimStats
from qnpipe.messages import Job


class SimSSD:
    """The simulated device; `run` must be running (see `open_simssd`) for a read to finish.

    `hop_s`: each batch reaches the device that long after it is submitted (the live read
    path's hand-offs, `cost.read_hop_s`)."""

    def __init__(self, profile: DeviceProfile, record_nbytes: Mapping[int, int], *, hop_s: float = 0.0) -> None:
        self.model = DeviceModel(profile, hop_s=hop_s)
        self.profile = self.model.profile
        self.record_nbytes = dict(record_nbytes)
        self._batches: dict[int, trio.Event] = {}
        self._next = 0
        self._kick = trio.Event()

    @property
    def stats(self) -> SimStats:
        return self.model.stats

    def submit(self, jobs: Sequence[Job]) -> Awaitable[list[int]]:
        """Put `jobs` on the device now (qnpipe.io.device.submit); await the result for their sizes."""
        sizes = [self.record_nbytes[j.layer] for j in jobs]
        done = trio.Event()
        if sizes:
            self._next += 1
            self._batches[self._next] = done
            self.model.submit(self._next, sizes, trio.current_time())
            self._kick.set()
        else:
            done.set()
        return self._wait(done, sizes)

    @staticmethod
    async def _wait(done: trio.Event, sizes: list[int]) -> list[int]:
        with trio.CancelScope(shield=True):  # a read in service finishes, as on the real device
            await done.wait()
        return sizes

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        return await self.submit(jobs)

    def statistics(self) -> SimStatistics:
        """The device's counters now, frozen (`busy_s` without the interval still open: see `busy_s()`)."""
        return self.model.stats.snapshot()

    def busy_s(self) -> float:
        """Seconds so far with at least one read in service (including the interval still open)."""
        return self.model.busy_s(trio.current_time())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The device task: completes reads as the model's times come, until cancelled."""
        task_status.started()
        while True:
            self._kick = trio.Event()  # a submission from here on wakes this task (its time may come first)
            with trio.move_on_at(self.model.next_time()):
                await self._kick.wait()
            for batch in self.model.advance(trio.current_time()):
                self._batches.pop(batch).set()
                # One waker per checkpoint: the woken readers run in completion order.
                await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_simssd(profile: DeviceProfile, record_nbytes: Mapping[int, int], *,
                      hop_s: float = 0.0) -> AsyncIterator[SimSSD]:
    """A `SimSSD` with its device task running for the duration of the block."""
    dev = SimSSD(profile, record_nbytes, hop_s=hop_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(dev.run)
        try:
            yield dev
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["PROFILES", "DeviceProfile", "SimSSD", "SimStatistics", "SimStats", "open_simssd"]
