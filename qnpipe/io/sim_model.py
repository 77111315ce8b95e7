"""The simulated SSD's service model, pure: batches in, completion times out, no clock of its own.

A batch's reads reach the device `hop_s` after it is submitted (the live read path's hand-off
to the reader's threads), wait FIFO for one of `queue_depth` service places, and each in
service finishes at `start + service_s(nbytes)`. A heap keyed by `(finish_t, seq)` orders
completions, so equal finish times complete in submission order. At one instant the device
completes first, then takes arrivals, then admits: a place freed at `t` is taken at `t`.

The caller owns the time: `submit(batch, sizes, now)`, then `advance(now)` whenever `now`
reaches `next_time()`, which returns the batches that finished. The trio shell
(qnpipe.io.simssd) and replay's heap driver (qnpipe.replay.fast) both drive this one model.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import attrs
import msgspec

from qnpipe.errors import ConfigError

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


@attrs.define
class SimStats:
    reads: int = 0
    bytes_read: int = 0
    busy_s: float = 0.0  # time with at least one read in service (closed intervals: see DeviceModel.busy_s)
    service_s: float = 0.0  # sum of every read's service time
    peak_in_service: int = 0
    peak_waiting: int = 0

    def snapshot(self) -> SimStatistics:
        return SimStatistics(reads=self.reads, bytes_read=self.bytes_read, busy_s=self.busy_s,
                             service_s=self.service_s, peak_in_service=self.peak_in_service,
                             peak_waiting=self.peak_waiting)


@attrs.frozen(kw_only=True)
class SimStatistics:
    """A frozen copy of a simulated device's `SimStats` (`SimSSD.statistics()`)."""

    reads: int
    bytes_read: int
    busy_s: float  # closed busy intervals only, as SimStats counts them
    service_s: float
    peak_in_service: int
    peak_waiting: int


class DeviceModel:
    """Reads in service, waiting and on their way, for one simulated device (see the module doc)."""

    __slots__ = ("_arrivals", "_busy_since", "_heap", "_left", "_seq", "_waiting", "hop_s", "profile",
                 "queue_depth", "stats")

    def __init__(self, profile: DeviceProfile, *, hop_s: float = 0.0) -> None:
        self.profile = profile.check()
        self.queue_depth = profile.queue_depth
        self.hop_s = hop_s
        self.stats = SimStats()
        self._waiting: deque[tuple[int, int]] = deque()  # (batch, nbytes)
        self._heap: list[tuple[float, int, int, int]] = []  # (finish, seq, batch, nbytes)
        self._arrivals: list[tuple[float, int, int, tuple[int, ...]]] = []  # (t, batch, batch, sizes)
        self._left: dict[int, int] = {}
        self._seq = 0
        self._busy_since: float | None = None

    def submit(self, batch: int, sizes: Sequence[int], now: float) -> None:
        """Batch `batch` (an id the caller gives, increasing) of reads of `sizes` bytes, submitted at `now`."""
        self._left[batch] = len(sizes)
        if self.hop_s:
            heapq.heappush(self._arrivals, (now + self.hop_s, batch, batch, tuple(sizes)))
            return
        self._waiting.extend((batch, n) for n in sizes)
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self._waiting))
        self._admit(now)

    def next_time(self) -> float:
        """When `advance` has something to do next (inf: nothing in service or on its way)."""
        t = self._heap[0][0] if self._heap else math.inf
        if self._arrivals and self._arrivals[0][0] < t:
            return self._arrivals[0][0]
        return t

    def advance(self, now: float) -> list[int]:
        """Complete what finished by `now`, take what arrived, admit; the batches that finished, in order."""
        done: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, batch, n = heapq.heappop(heap)
            self.stats.reads += 1
            self.stats.bytes_read += n
            self._left[batch] -= 1
            if not self._left[batch]:
                del self._left[batch]
                done.append(batch)
            if not heap and self._busy_since is not None:
                self.stats.busy_s += now - self._busy_since
                self._busy_since = None
        while self._arrivals and self._arrivals[0][0] <= now:
            _, _, batch, sizes = heapq.heappop(self._arrivals)
            self._waiting.extend((batch, n) for n in sizes)
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self._waiting))
        self._admit(now)
        return done

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._heap) < self.queue_depth:
            batch, n = self._waiting.popleft()
            s = self.profile.service_s(n)
            self.stats.service_s += s
            if self._busy_since is None:
                self._busy_since = now
            heapq.heappush(self._heap, (now + s, self._seq, batch, n))
            self._seq += 1
        self.stats.peak_in_service = max(self.stats.peak_in_service, len(self._heap))

    def busy_s(self, now: float) -> float:
        """Seconds until `now` with at least one read in service (including the interval still open)."""
        return self.stats.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def idle(self) -> bool:
        return not (self._heap or self._waiting or self._arrivals)


__all__ = ["PROFILES", "DeviceModel", "DeviceProfile", "SimStatistics", "SimStats"]
