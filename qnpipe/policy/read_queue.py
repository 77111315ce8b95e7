"""The read queue over one device: priority classes, duplicate merging, an in-flight budget.

The read scheduler pushes jobs as the pool asks for them and pulls batches to put on the
device. Demand reads (a step is waiting) always go before prefetches; within a class,
first come first served. A job for an expert already queued or in flight is merged into
it (read once, every asker told); a demand merged into a queued prefetch promotes it to
the back of the demand queue. At most `max_in_flight` reads are on the device at once.
"""

from __future__ import annotations

import enum
from collections import deque

import attrs


class ReadClass(enum.IntEnum):
    """Priority class of a read; lower goes first."""

    DEMAND = 0
    PREFETCH = 1


@attrs.frozen(slots=True)
class Job:
    """Read expert `expert` of `layer` into `slot`."""

    layer: int
    expert: int
    slot: int
    cls: ReadClass = ReadClass.DEMAND

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)


@attrs.define(slots=True)
class ReadQueue:
    """Queued and in-flight reads. `batch`: hand out every job the budget allows at once."""

    max_in_flight: int
    batch: bool = True
    queues: dict[ReadClass, deque[Job]] = attrs.field(factory=lambda: {c: deque() for c in ReadClass})
    queued: dict[tuple[int, int], Job] = attrs.field(factory=dict)
    in_flight: dict[tuple[int, int], Job] = attrs.field(factory=dict)
    merged: int = 0
    peak_in_flight: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")

    def push(self, job: Job) -> bool:
        """Queue `job`; False when it merged into a read already queued or in flight."""
        if job.key in self.queued or job.key in self.in_flight:
            known = self.queued.get(job.key) or self.in_flight[job.key]
            if known.slot != job.slot:
                raise AssertionError(f"layer {job.layer} expert {job.expert}: asked into slot {job.slot} "
                                     f"while its read into slot {known.slot} is pending")
            self.merged += 1
            if job.cls < known.cls and job.key in self.queued:  # a step now waits on a queued prefetch
                self.queues[known.cls].remove(known)
                self.queued[job.key] = promoted = attrs.evolve(known, cls=job.cls)
                self.queues[job.cls].append(promoted)
            return False
        self.queued[job.key] = job
        self.queues[job.cls].append(job)
        return True

    def take(self) -> list[Job]:
        """The jobs to start now (empty when the budget is used up or nothing is queued)."""
        out: list[Job] = []
        room = self.max_in_flight - len(self.in_flight)
        limit = room if self.batch else min(room, 1)
        for cls in ReadClass:
            q = self.queues[cls]
            while q and len(out) < limit:
                job = q.popleft()
                del self.queued[job.key]
                self.in_flight[job.key] = job
                out.append(job)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return out

    def done(self, job: Job) -> None:
        """`job` left the device (read or failed)."""
        del self.in_flight[job.key]

    def __len__(self) -> int:
        return len(self.queued) + len(self.in_flight)
