"""The live device under the read scheduler: the SSD reader filling the pool's slot arrays.

`ExpertDevice` is the seam: the read scheduler hands it batches of jobs (expert ids and
slots, no buffers) and awaits them; replay swaps in a simulated device. The live one
turns each job into a `ReadRequest` that scatters the record into its slot's host views
and puts the batch on the reader's own threads from the trio loop itself (`SsdReader.start`):
the loop waits on a file descriptor those threads write when the batch is done, so no thread
of ours and no hand-over of the GIL lies on a read's way in or out. A reader that cannot
(`read_batch` only: the Python backend, checksums verified on read) runs in a worker thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import trio

from qnpipe.io.reader import ExpertReader, ReaderStats, ReadRequest, WritableBuffer, scatter_buffers
from qnpipe.io.sim_model import SimStatistics
from qnpipe.io.slot_writes import SlotWrites
from qnpipe.io.store import ExpertStore
from qnpipe.messages import Job

T = TypeVar("T")
DeviceStatistics = ReaderStats | SimStatistics  # a device's own counters, frozen: its reader's, or simulated
SlotDest = Callable[[int, int], Mapping[str, WritableBuffer]]  # (layer, slot) -> tensor name -> buffer


# Reads put on the reader's threads from the loop (`SsdReader.start`). False runs every batch on a
# submitter thread, as before: tests comparing the two ways and tools/bench_stream.py's A/B set it.
_start_reads = True
# Reads put on the device at targets planned once per slot (`SsdReader.start_at`): no request or plan is built per
# read unless one fails. False builds them all (A/B benchmarks, tests comparing the two ways).
_in_place = True


class ExpertDevice(Protocol):
    """Reads experts into pool slots."""

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        """Read every job (all of them, or raise `qnpipe.errors.ReadError`); the bytes read per job."""
        ...

    def statistics(self) -> DeviceStatistics | None:
        """A frozen snapshot of the device's counters: its reader's, or a simulated device's; None without."""
        ...


def submit(device: ExpertDevice, jobs: Sequence[Job]) -> Awaitable[list[int]]:
    """Start `jobs` on `device` now, when it can; await the result for `read`'s value.

    A device with a `submit` method of this signature puts the reads on its way before
    returning (`StoreDevice`: on one of its submitter threads), so the read scheduler's turn, not a
    task started a scheduler batch later, is when the I/O begins; one with `read` alone
    starts when the awaitable is first awaited. Either way the awaitable must be awaited.
    """
    start = getattr(device, "submit", None)
    return start(jobs) if start is not None else device.read(jobs)


class StoreDevice:
    """`ExpertDevice` over an `ExpertStore` and an `ExpertReader` (the real SSD)."""

    # Its reads write into slot memory, so their waits are shielded: nothing can cancel one (the read scheduler
    # then spares a wait of its in another task the cancel scope that could not stop it).
    shields_reads = True

    def __init__(self, store: ExpertStore, reader: ExpertReader, dest: SlotDest, *, verify_crc32: bool,
                 writes: SlotWrites | None = None) -> None:
        self._store = store
        # Told when each batch starts and ends writing into slots (qnpipe.model.speculate).
        self._writes = writes
        self._reader = reader
        self._dest = dest
        self._verify = verify_crc32
        # A slot's scatter list never changes (its scratch parts are only ever written), so build it once.
        self._bufs: dict[tuple[int, int], WritableBuffer] = {}
        self._prepare: Callable[[WritableBuffer, int, str], WritableBuffer] | None = getattr(reader, "prepare", None)
        self._where: dict[int, tuple[str, int, Any]] = {}  # layer -> (path, record_nbytes, LayerFile)
        self._submitter = Submitter()
        self._starts = _start_reads and bool(getattr(reader, "starts", False))  # no thread of ours in the way
        self._in_place = self._starts and _in_place and hasattr(reader, "start_at") and self._prepare is not None
        # (layer, slot) -> its reads' target (None: they bounce), the record stride and the layer's expert count.
        self._targets: dict[tuple[int, int], tuple[Any, int, int]] = {}
        self._wakeups = Wakeups()

    def request(self, job: Job) -> ReadRequest:
        where = self._where.get(job.layer)
        if where is None:  # once per layer: record_location builds a Path, too slow for every read
            lf = self._store.layer_file(job.layer)
            path, _, nbytes = self._store.record_location(job.layer, 0)
            where = self._where[job.layer] = (str(path), nbytes, lf)
        path, nbytes, lf = where
        if not 0 <= job.expert < lf.num_experts:
            self._store.record_location(job.layer, job.expert)  # raises, naming the store and expert
        buf = self._bufs.get((job.layer, job.slot))
        if buf is None:
            buf = scatter_buffers(lf.tensors, nbytes, self._dest(job.layer, job.slot))
            if self._prepare is not None:  # taken apart once, not at every read (qnpipe.io.ssd.Prepared)
                buf = self._prepare(buf, nbytes, f"layer {job.layer} slot {job.slot}")
            self._bufs[(job.layer, job.slot)] = buf
        return ReadRequest(path=path, offset=job.expert * lf.stride, nbytes=nbytes, buf=buf, layer=job.layer,
                           expert=job.expert, crc32=lf.checksums[job.expert] if self._verify else None)

    def _at(self, jobs: Sequence[Job]) -> list[tuple[Any, int]] | None:
        """The jobs as `SsdReader.start_at`'s (target, offset) pairs; None when one of them would bounce."""
        at = []
        targets, epoch = self._targets, self._reader.epoch  # pyright: ignore[reportAttributeAccessIssue]
        for job in jobs:
            known = targets.get((job.layer, job.slot))
            if known is None or (known[0] is not None and known[0].epoch != epoch):
                request = self.request(job)  # checks the expert, builds the slot's destination once
                lf = self._where[job.layer][2]
                target = self._reader.target(request.path, request.buf)  # pyright: ignore[reportAttributeAccessIssue]
                known = targets[(job.layer, job.slot)] = (target, lf.stride, lf.num_experts)
            target, stride, experts = known
            if target is None:
                return None
            if not 0 <= job.expert < experts:
                self.request(job)  # raises, naming the store and expert
            at.append((target, job.expert * stride))
        return at

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        return await self.submit(jobs)

    def submit(self, jobs: Sequence[Job]) -> Awaitable[list[int]]:
        """Put the batch on the device now; the awaitable waits for it (qnpipe.io.device.submit)."""
        writes = self._writes
        if self._starts:
            at = self._at(jobs) if self._in_place else None
            reqs = [self.request(j) for j in jobs] if at is None else ()
            pair = self._wakeups.take()
            if writes is not None:
                writes.begin()
            try:
                if at is None:
                    pending = self._reader.start(reqs, pair[1])  # pyright: ignore[reportAttributeAccessIssue]
                else:
                    pending = self._reader.start_at(  # pyright: ignore[reportAttributeAccessIssue]
                        at, pair[1], lambda: [self.request(j) for j in jobs])
            except BaseException:
                self._wakeups.give(pair)
                if writes is not None:
                    writes.end()
                raise
            return self._wait(pending, pair)
        reqs = [self.request(j) for j in jobs]
        if writes is None:
            return _nbytes(self._submitter.start(self._reader.read_batch, reqs))

        def read_batch(reqs: list[ReadRequest]) -> Any:
            try:
                return self._reader.read_batch(reqs)
            finally:
                writes.end()

        writes.begin()
        try:
            return _nbytes(self._submitter.start(read_batch, reqs))
        except BaseException:
            writes.end()
            raise

    async def _wait(self, pending: Any, pair: tuple[int, int]) -> list[int]:
        drained = False
        results = None
        try:
            with trio.CancelScope(shield=True):  # the reads write into slot memory: they must be waited for
                while results is None:
                    drained = False
                    await trio.lowlevel.wait_readable(pair[0])
                    os.read(pair[0], 8)
                    drained = True
                    results = pending.poll_nbytes()  # None: an attempt again, the fd is written again
            assert results is not None  # the shield never swallows an exception here: narrowed for pyright
            return results
        finally:
            if drained:
                self._wakeups.give(pair)
            else:  # interrupted: the batch may write the fd yet, so it is not reused
                self._wakeups.discard(pending)
            if self._writes is not None:
                self._writes.end()

    def close(self) -> None:
        """Stop the submitter threads and close the wake-up descriptors (idempotent)."""
        self._submitter.close()
        self._wakeups.close()

    def statistics(self) -> ReaderStats | None:
        return self._reader.statistics()


class Submitter:
    """A few long-lived threads that run blocking batch reads for the trio loop.

    Cheaper per batch than `trio.to_thread.run_sync` (measured 36 vs 55 us idle, and the
    gap widens under load), and known threads that `close` joins. There are `THREADS` of
    them so that batches in flight at once run at once, as the simulated device serves
    them (qnpipe.io.simssd): with one thread a demand batch would wait for a prefetch
    batch already on the device to finish before its reads were even queued. The reader
    bounds the reads in flight across its callers. A waiting caller is not abandoned on
    cancel: the read writes into slot memory, so it must finish.
    """

    THREADS = 4  # a demand and a prefetch batch at once, with room for a second of each

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Queue `fn(*args)` on a thread now (from trio); the awaitable waits for its value."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._loop, name="qnpipe-read-submit", daemon=True)
                             for _ in range(self.THREADS)]
            for t in self._threads:
                t.start()
        done = trio.Event()
        box: list[Any] = []
        self._q.put((fn, args, trio.lowlevel.current_trio_token(), done, box))
        return _outcome(done, box)

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            fn, args, token, done, box = item
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # handed to the waiting trio task
                box.append((False, e))
            token.run_sync_soon(done.set)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class Wakeups:
    """File descriptors the reader's threads write when a batch is done, kept for the next batch.

    A pair (read end, write end): one eventfd on Linux, a pipe elsewhere; 8 bytes are written
    and read per batch, so a returned pair is empty again.
    """

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []
        self._open: set[tuple[int, int]] = set()
        self._stray: list[Any] = []  # PendingRead of the pairs discarded

    def take(self) -> tuple[int, int]:
        if self._free:
            return self._free.pop()
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_CLOEXEC)
            pair = (fd, fd)
        else:
            r, w = os.pipe()
            pair = (r, w)
        self._open.add(pair)
        return pair

    def give(self, pair: tuple[int, int]) -> None:
        self._free.append(pair)

    def discard(self, pending: Any) -> None:
        """A pair taken and not given back, whose wait ended before its batch `pending` (a `PendingRead`)
        wrote it: never reused, and closed only once that batch is done."""
        self._stray.append(pending)

    def close(self) -> None:
        """Close every pair, once the batches of discarded ones are done (they write into them)."""
        for pending in self._stray:
            pending.settle()
        for pair in self._open:
            _close_pair(pair)
        self._open.clear()
        self._free.clear()
        self._stray.clear()


def _close_pair(pair: tuple[int, int]) -> None:
    for fd in set(pair):
        os.close(fd)


async def _outcome(done: trio.Event, box: list[Any]) -> Any:
    with trio.CancelScope(shield=True):  # the read writes into slot memory: it must be waited for
        await done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


async def _nbytes(results: Awaitable[list[Any]]) -> list[int]:
    return [r.nbytes for r in await results]
