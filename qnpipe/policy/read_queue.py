"""The read queue over one device: priority classes, duplicate merging, an in-flight budget.

The read scheduler pushes jobs as the pool asks for them and pulls batches to put on the
device. Demand reads (a step is waiting) always go before prefetches; within a class,
first come first served. A job for an expert already queued or in flight is merged into
it (read once, every asker told); a demand merged into a queued prefetch promotes it to
the back of the demand queue. At most `max_in_flight` reads are on the device at once.
`Job` and `ReadClass`, the read unit, are qnpipe.messages' (re-exported here).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import attrs

from qnpipe.messages import Job, ReadClass

__all__ = ["Job", "ReadClass", "ReadQueue"]


@attrs.define(slots=True)
class ReadQueue:
    """Queued and in-flight reads. `batch`: hand out every job the budget allows at once.

    `max_prefetch_in_flight` caps prefetches on the device (`read.bg_budget_experts`), so
    speculation never takes every slot of the device from a demand that comes next.
    Prefetches go by deadline, then by score; one whose deadline has passed when its
    turn comes is not started but returned by `pop_expired` (its slot must be freed).
    """

    max_in_flight: int
    batch: bool = True
    max_prefetch_in_flight: int | None = None
    demand: deque[Job] = attrs.field(factory=deque)
    prefetch: list[tuple[float, float, int, Job]] = attrs.field(factory=list)  # heap; stale entries skipped
    queued: dict[tuple[int, int], Job] = attrs.field(factory=dict)
    in_flight: dict[tuple[int, int], Job] = attrs.field(factory=dict)
    expired: list[Job] = attrs.field(factory=list)
    merged: int = 0
    peak_in_flight: int = 0
    prefetch_in_flight: int = 0
    _order: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")

    def push(self, job: Job) -> bool:
        """Queue `job`; False when it merged into a read already queued or in flight.

        A demand merged into a queued prefetch turns it into a demand read (a step waits on it).
        """
        if job.key in self.queued or job.key in self.in_flight:
            known = self.queued.get(job.key) or self.in_flight[job.key]
            if known.slot != job.slot:
                raise AssertionError(f"layer {job.layer} expert {job.expert}: asked into slot {job.slot} "
                                     f"while its read into slot {known.slot} is pending")
            self.merged += 1
            if job.cls < known.cls and job.key in self.queued:  # the heap entry goes stale
                self.queued[job.key] = promoted = attrs.evolve(known, cls=job.cls, deadline=math.inf)
                self.demand.append(promoted)
            return False
        self.queued[job.key] = job
        if job.cls is ReadClass.DEMAND:
            self.demand.append(job)
        else:
            self._order += 1
            heapq.heappush(self.prefetch, (job.deadline, -job.score, self._order, job))
        return True

    def promote(self, key: tuple[int, int]) -> bool:
        """A queued prefetch becomes a demand read; False when it is not queued (in flight, done or gone)."""
        known = self.queued.get(key)
        if known is None or known.cls is ReadClass.DEMAND:
            return False
        self.queued[key] = promoted = attrs.evolve(known, cls=ReadClass.DEMAND, deadline=math.inf)
        self.demand.append(promoted)
        return True

    def starts_at_once(self, jobs: Sequence[Job]) -> bool:
        """Whether pushing the demand reads `jobs` and taking would start exactly them, in order, as one batch:
        no demand read is queued ahead, none of them merges (queued, in flight, or twice) and the budget has room."""
        room = self.max_in_flight - len(self.in_flight)
        if self.demand or not jobs or len(jobs) > (room if self.batch else min(room, 1)):
            return False
        keys = {job.key for job in jobs}
        return len(keys) == len(jobs) and keys.isdisjoint(self.queued) and keys.isdisjoint(self.in_flight)

    def take(self, now: float = -math.inf) -> list[Job]:
        """The jobs to start now, all of one class (empty when the budget is used up or nothing is queued).

        A device reports a batch when all of it is read, so a demand read batched with
        prefetches would wait for them: demand reads go in a batch of their own, and the
        next call hands out the prefetches.
        """
        out: list[Job] = []
        room = self.max_in_flight - len(self.in_flight)
        limit = room if self.batch else min(room, 1)
        while self.demand and len(out) < limit:
            job = self.demand.popleft()
            if self.queued.get(job.key) is not job:
                continue
            self._start(job, out)
        if out:
            self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
            return out
        cap = self.max_prefetch_in_flight
        while self.prefetch and len(out) < limit and (cap is None or self.prefetch_in_flight < cap):
            job = heapq.heappop(self.prefetch)[3]
            if self.queued.get(job.key) is not job:  # promoted to a demand read, or taken
                continue
            if job.deadline < now:
                del self.queued[job.key]
                self.expired.append(job)
                continue
            self._start(job, out)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return out

    def _start(self, job: Job, out: list[Job]) -> None:
        del self.queued[job.key]
        self.in_flight[job.key] = job
        if job.cls is ReadClass.PREFETCH:
            self.prefetch_in_flight += 1
        out.append(job)

    def pop_expired(self) -> list[Job]:
        """Prefetches dropped because their deadline passed before they could start."""
        out, self.expired = self.expired, []
        return out

    def done(self, job: Job) -> None:
        """`job` left the device (read or failed)."""
        known = self.in_flight.pop(job.key)
        if known.cls is ReadClass.PREFETCH:
            self.prefetch_in_flight -= 1

    def __len__(self) -> int:
        return len(self.queued) + len(self.in_flight)
