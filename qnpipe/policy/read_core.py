"""The read scheduler's decisions, sans I/O: requests in, batches to put on the device out.

`ReadCore.handle(msg, now)` queues a `ReadExperts`, applies a `Promote`, or books a
`BatchDone` (a batch left the device: the pool gets its `ReadsDone`); `end_turn(now)`
answers with the batches to start now (as the in-flight budget allows, in
`Outbox.batches`) and tells the pool of prefetches that expired. The trio actor
(qnpipe.actors.read_scheduler) and replay's heap driver (qnpipe.replay.fast) both run it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import assert_never

import attrs
import msgspec

from qnpipe.config import Config
from qnpipe.messages import Promote, ReadDone, ReadExperts, ReadExpired, ReadInbox, ReadsDone
from qnpipe.policy.outbox import Batch, Outbox
from qnpipe.policy.read_queue import Job, ReadClass, ReadQueue
from qnpipe.trace.format import ReadStarted


def read_queue(cfg: Config) -> ReadQueue:
    """The read queue `cfg.read` asks for (both drivers' read scheduler)."""
    return ReadQueue(cfg.read.workers, batch=cfg.read.batch_miss_read,
                     max_prefetch_in_flight=cfg.read.bg_budget_experts or None)


@attrs.define
class ReadSchedulerStats:
    """Counters of the read scheduler (device time sums batch wall times, which may overlap); merged reads
    and the peak in flight are its queue's to count (`ReadQueue.merged`, `.peak_in_flight`)."""

    requests: int = 0
    batches: int = 0
    reads: int = 0
    bytes_read: int = 0
    device_s: float = 0.0
    promoted: int = 0  # queued prefetches turned into demand reads
    expired: int = 0  # prefetches not started: their deadline had passed


@attrs.frozen(kw_only=True)
class ReadSchedulerSnapshot:
    """`ReadSchedulerStats` as they were at one moment (`ReadCore.statistics()`, the pipeline's `reads`);
    `merged` and `peak_in_flight` are its queue's (qnpipe.policy.read_queue): the queue merges and starts reads."""

    requests: int
    merged: int
    batches: int
    reads: int
    bytes_read: int
    device_s: float
    peak_in_flight: int
    promoted: int
    expired: int


class BatchDone(msgspec.Struct, frozen=True):
    """`batch` left the device (`nbytes` read per job): the driver's input when its reads are done."""

    batch: Batch
    nbytes: tuple[int, ...] | list[int]


@attrs.define
class ReadCore:
    """The read scheduler's turn logic over `queue`; `logging`: fill `Outbox.log` with the event-log records."""

    queue: ReadQueue
    stats: ReadSchedulerStats = attrs.field(factory=ReadSchedulerStats)
    logging: bool = False
    seq: int = 0
    batches: int = 0
    issued: dict[tuple[int, int], float] = attrs.field(factory=dict)  # read -> when the pool asked for it

    def _seq(self) -> int:
        self.seq += 1
        return self.seq

    def statistics(self) -> ReadSchedulerSnapshot:
        return ReadSchedulerSnapshot(**attrs.asdict(self.stats) | {"merged": self.queue.merged,
                                                                  "peak_in_flight": self.queue.peak_in_flight})

    def handle(self, msg: ReadInbox | BatchDone, now: float) -> Outbox:
        out = Outbox()
        self._handle(msg, now, out)
        return out

    def batch_at_once(self, msgs: Sequence[ReadInbox]) -> list[Job] | None:
        """The batch a turn over `msgs` puts on the device first, when it is known before the turn: one demand
        `ReadExperts` whose reads all start at once (`ReadQueue.starts_at_once`). A driver may put it on the
        device before taking the turn (the turn's first batch then equals it); None otherwise."""
        if len(msgs) != 1 or not isinstance(msg := msgs[0], ReadExperts) or msg.cls is not ReadClass.DEMAND:
            return None
        scores = msg.scores or (0.0,) * len(msg.experts)
        jobs = [Job(msg.layer, e, s, msg.cls, msg.deadline, c) for e, s, c in zip(msg.experts, msg.slots, scores,
                                                                                 strict=True)]
        return jobs if self.queue.starts_at_once(jobs) else None

    def turn(self, msgs: Iterable[ReadInbox | BatchDone], now: float) -> Outbox:
        """A whole turn: `handle` of each of `msgs` in order, then `end_turn`, answered as one `Outbox`
        (what extending their answers in order gives)."""
        out = Outbox()
        for msg in msgs:
            self._handle(msg, now, out)
        self._end_turn(now, out)
        return out

    def _handle(self, msg: ReadInbox | BatchDone, now: float, out: Outbox) -> None:
        match msg:
            case Promote():
                self.stats.promoted += self.queue.promote((msg.layer, msg.expert))
            case ReadExperts():
                scores = msg.scores or (0.0,) * len(msg.experts)
                self.stats.requests += len(msg.experts)
                layer, cls, deadline, push, issued = msg.layer, msg.cls, msg.deadline, self.queue.push, self.issued
                for expert, slot, score in zip(msg.experts, msg.slots, scores, strict=True):
                    job = Job(layer, expert, slot, cls, deadline, score)
                    if push(job):
                        issued[job.key] = msg.t
            case BatchDone():
                self._complete(msg.batch, msg.nbytes, now, out)
            case _:
                assert_never(msg)

    def end_turn(self, now: float) -> Outbox:
        """The batches to put on the device now; expired prefetches go to the pool as `ReadExpired`."""
        out = Outbox()
        self._end_turn(now, out)
        return out

    def _end_turn(self, now: float, out: Outbox) -> None:
        while jobs := self.queue.take(now):
            if self.logging:
                out.log += [ReadStarted(t=now, seq=self._seq(), layer=j.layer, expert=j.expert, slot=j.slot)
                            for j in jobs]
            self.batches += 1
            out.batches.append(Batch(self.batches, jobs, now))
        if not self.queue.expired:
            return
        for job in self.queue.pop_expired():
            self.stats.expired += 1
            self.issued.pop(job.key, None)
            out.pool.append(ReadExpired(t=now, seq=self._seq(), layer=job.layer, expert=job.expert, slot=job.slot))

    def _complete(self, batch: Batch, nbytes: tuple[int, ...] | list[int], now: float, out: Outbox) -> None:
        stats = self.stats
        stats.batches += 1
        stats.device_s += now - batch.started
        for job, n in zip(batch.jobs, nbytes, strict=True):
            self.queue.done(job)
            stats.reads += 1
            stats.bytes_read += n
        jobs = batch.jobs
        asked = tuple(self.issued.pop(job.key) for job in jobs)
        done = ReadsDone(t=now, seq=self._seq(), layers=tuple(j.layer for j in jobs),
                         experts=tuple(j.expert for j in jobs), slots=tuple(j.slot for j in jobs),
                         nbytes=tuple(nbytes), issued_t=asked, started_t=batch.started)
        if self.logging:
            out.log += [ReadDone(t=now, seq=self._seq(), layer=job.layer, expert=job.expert, slot=job.slot, nbytes=n,
                                 issued_t=t, started_t=batch.started)
                        for job, n, t in zip(jobs, nbytes, asked, strict=True)]
        out.pool.append(done)


__all__ = ["Batch", "BatchDone", "ReadCore", "ReadSchedulerSnapshot", "ReadSchedulerStats", "read_queue"]
