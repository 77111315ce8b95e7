"""A simulated SSD: an `ExpertDevice` whose reads take modelled time on the trio clock (replay).

One task owns the device (style §6.2, the SimPy design): reads wait FIFO for one of
`queue_depth` service places, each in service finishes at `start + latency + per_mb * MB
+ nbytes / bandwidth`, and a heap keyed by `(finish_t, seq)` decides the completion
order, so equal finish times complete in submission order on every run. A task per read
would complete same-time reads in a random order (§6.1). Nothing touches memory: the
slots of a replay hold no data. No threads (§6.3): run it under `MockClock`.

    async with open_simssd(profile, record_nbytes) as dev:
        ...  # dev.read(jobs) from any task
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import msgspec
import trio

from qnpipe.errors import ConfigError
from qnpipe.policy.read_queue import Job

# Bounds of a profile: far beyond any real device (1 B/s is slow enough for any what-if), far
# below what breaks the virtual clock's arithmetic or the device's bookkeeping.
MIN_BANDWIDTH = 1.0
MAX_BANDWIDTH = 1e15
MAX_LATENCY_S = 3600.0
MAX_QUEUE_DEPTH = 1 << 16


class DeviceProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a device serves reads: sustained bandwidth, a fixed and a per-MB latency, reads in service at once."""

    bandwidth_bytes_per_s: float
    latency_s: float
    per_mb_latency_s: float = 0.0
    queue_depth: int = 1

    def service_s(self, nbytes: int) -> float:
        """Seconds one read of `nbytes` spends in service."""
        return self.latency_s + self.per_mb_latency_s * nbytes / 1e6 + nbytes / self.bandwidth_bytes_per_s

    def check(self, where: str = "") -> DeviceProfile:
        """Self, or ConfigError (a ValueError) naming the bad field (`where` + its name) and its value."""
        bw = self.bandwidth_bytes_per_s
        if not (math.isfinite(bw) and MIN_BANDWIDTH <= bw <= MAX_BANDWIDTH):
            raise ConfigError(f"{where}bandwidth_bytes_per_s={bw!r}: must be a finite number in "
                              f"[{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}] (bytes per second)")
        for name in ("latency_s", "per_mb_latency_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= MAX_LATENCY_S):
                raise ConfigError(f"{where}{name}={v!r}: must be a finite number of seconds in [0, {MAX_LATENCY_S:g}]")
        if not 1 <= self.queue_depth <= MAX_QUEUE_DEPTH:
            raise ConfigError(f"{where}queue_depth={self.queue_depth}: must be >= 1 and <= {MAX_QUEUE_DEPTH}")
        return self


PROFILES: dict[str, DeviceProfile] = {
    # Apple M5 internal SSD, the figures of issue 11: ~6.8 GB/s, 36 us + 49 us per MB, 8 in flight.
    "apple-m5-internal": DeviceProfile(bandwidth_bytes_per_s=6.8e9, latency_s=36e-6, per_mb_latency_s=49e-6,
                                       queue_depth=8),
}


@attrs.define(eq=False)
class _Batch:
    nbytes: list[int]
    left: int
    done: trio.Event = attrs.field(factory=trio.Event)


@attrs.define
class SimStats:
    reads: int = 0
    bytes_read: int = 0
    busy_s: float = 0.0  # time with at least one read in service (closed intervals: see SimSSD.busy_s)
    service_s: float = 0.0  # sum of every read's service time
    peak_in_service: int = 0
    peak_waiting: int = 0


class SimSSD:
    """The simulated device; `run` must be running (see `open_simssd`) for `read` to return."""

    def __init__(self, profile: DeviceProfile, record_nbytes: Mapping[int, int]) -> None:
        self.profile = profile.check()
        self.record_nbytes = dict(record_nbytes)
        self.stats = SimStats()
        self._tx, self._rx = trio.open_memory_channel[tuple[_Batch, int]](math.inf)
        self._waiting: deque[tuple[_Batch, int]] = deque()
        self._heap: list[tuple[float, int, _Batch]] = []
        self._seq = 0
        self._busy_since: float | None = None

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        if not jobs:
            return []
        batch = _Batch([self.record_nbytes[j.layer] for j in jobs], len(jobs))
        for n in batch.nbytes:
            self._tx.send_nowait((batch, n))  # unbounded: a read never waits to be queued
        with trio.CancelScope(shield=True):  # a read in service finishes, as on the real device
            await batch.done.wait()
        return batch.nbytes

    def statistics(self) -> None:
        return None

    def busy_s(self) -> float:
        """Seconds so far with at least one read in service (including the interval still open)."""
        open_s = trio.current_time() - self._busy_since if self._busy_since is not None else 0.0
        return self.stats.busy_s + open_s

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._heap) < self.profile.queue_depth:
            batch, n = self._waiting.popleft()
            s = self.profile.service_s(n)
            self.stats.service_s += s
            if self._busy_since is None:
                self._busy_since = now
            heapq.heappush(self._heap, (now + s, self._seq, batch))
            self._seq += 1
        self.stats.peak_in_service = max(self.stats.peak_in_service, len(self._heap))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The device task: admits, serves and completes reads until cancelled."""
        task_status.started()
        while True:
            now = trio.current_time()
            self._admit(now)
            if not self._heap:
                self._waiting.append(await self._rx.receive())
            else:
                with trio.move_on_at(self._heap[0][0]):
                    self._waiting.append(await self._rx.receive())
            while True:  # everything already submitted joins the FIFO in submission order
                try:
                    self._waiting.append(self._rx.receive_nowait())
                except trio.WouldBlock:
                    break
            self.stats.peak_waiting = max(self.stats.peak_waiting, len(self._waiting))
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                _, _, batch = heapq.heappop(self._heap)
                self.stats.reads += 1
                batch.left -= 1
                if batch.left == 0:
                    self.stats.bytes_read += sum(batch.nbytes)
                    batch.done.set()
                    # One waker per checkpoint: the woken readers run in completion order.
                    await trio.lowlevel.checkpoint()
                if not self._heap and self._busy_since is not None:
                    self.stats.busy_s += now - self._busy_since
                    self._busy_since = None


@asynccontextmanager
async def open_simssd(profile: DeviceProfile, record_nbytes: Mapping[int, int]) -> AsyncIterator[SimSSD]:
    """A `SimSSD` with its device task running for the duration of the block."""
    dev = SimSSD(profile, record_nbytes)
    async with trio.open_nursery() as nursery:
        await nursery.start(dev.run)
        try:
            yield dev
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["PROFILES", "DeviceProfile", "SimSSD", "SimStats", "open_simssd"]
