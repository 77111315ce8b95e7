"""The live device under the read scheduler: the SSD reader filling the pool's slot arrays.

`ExpertDevice` is the seam: the read scheduler hands it batches of jobs (expert ids and
slots, no buffers) and awaits them; replay swaps in a simulated device. The live one
turns each job into a `ReadRequest` that scatters the record into its slot's host views
and runs the blocking `read_batch` in a worker thread, so the trio loop never blocks.
"""

from __future__ import annotations

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

    def __init__(self, store: ExpertStore, reader: ExpertReader, dest: SlotDest, *, verify_crc32: bool,
                 writes: SlotWrites | None = None) -> None:
        self._store = store
        # Told when each batch starts and ends writing into slots (qnpipe.model.speculate).
        self._writes = writes
        self._reader = reader
        self._dest = dest
        self._verify = verify_crc32
        # A slot's scatter list never changes (its scratch parts are only ever written), so build it once.
        self._bufs: dict[tuple[int, int], tuple[WritableBuffer, ...]] = {}
        self._where: dict[int, tuple[str, int, Any]] = {}  # layer -> (path, record_nbytes, LayerFile)
        self._submitter = Submitter()

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
            buf = self._bufs[(job.layer, job.slot)] = scatter_buffers(lf.tensors, nbytes,
                                                                      self._dest(job.layer, job.slot))
        return ReadRequest(path=path, offset=job.expert * lf.stride, nbytes=nbytes, buf=buf, layer=job.layer,
                           expert=job.expert, crc32=lf.checksums[job.expert] if self._verify else None)

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        return await self.submit(jobs)

    def submit(self, jobs: Sequence[Job]) -> Awaitable[list[int]]:
        """Hand the batch to a submitter thread now; the awaitable waits for it (qnpipe.io.device.submit)."""
        reqs = [self.request(j) for j in jobs]
        writes = self._writes
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

    def close(self) -> None:
        """Stop the submitter threads (idempotent)."""
        self._submitter.close()

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


async def _outcome(done: trio.Event, box: list[Any]) -> Any:
    with trio.CancelScope(shield=True):  # the read writes into slot memory: it must be waited for
        await done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


async def _nbytes(results: Awaitable[list[Any]]) -> list[int]:
    return [r.nbytes for r in await results]
