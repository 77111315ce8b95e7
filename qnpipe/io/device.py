"""The live device under the read scheduler: the SSD reader filling the pool's slot arrays.

`ExpertDevice` is the seam: the read scheduler hands it batches of jobs (expert ids and
slots, no buffers) and awaits them; replay swaps in a simulated device. The live one
turns each job into a `ReadRequest` that scatters the record into its slot's host views
and runs the blocking `read_batch` in a worker thread, so the trio loop never blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import trio

from qnpipe.io.reader import ExpertReader, ReaderStats, ReadRequest, WritableBuffer, scatter_buffers
from qnpipe.io.store import ExpertStore
from qnpipe.policy.read_queue import Job

SlotDest = Callable[[int, int], Mapping[str, WritableBuffer]]  # (layer, slot) -> tensor name -> buffer


class ExpertDevice(Protocol):
    """Reads experts into pool slots."""

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        """Read every job (all of them, or raise `qnpipe.errors.ReadError`); the bytes read per job."""
        ...

    def statistics(self) -> ReaderStats | None:
        """The underlying reader's counters, when there is one."""
        ...


class StoreDevice:
    """`ExpertDevice` over an `ExpertStore` and an `ExpertReader` (the real SSD)."""

    def __init__(self, store: ExpertStore, reader: ExpertReader, dest: SlotDest, *, verify_crc32: bool) -> None:
        self._store = store
        self._reader = reader
        self._dest = dest
        self._verify = verify_crc32
        # A slot's scatter list never changes (its scratch parts are only ever written), so build it once.
        self._bufs: dict[tuple[int, int], tuple[WritableBuffer, ...]] = {}

    def request(self, job: Job) -> ReadRequest:
        lf = self._store.layer_file(job.layer)
        path, offset, nbytes = self._store.record_location(job.layer, job.expert)
        buf = self._bufs.get((job.layer, job.slot))
        if buf is None:
            buf = self._bufs[(job.layer, job.slot)] = scatter_buffers(lf.tensors, nbytes,
                                                                      self._dest(job.layer, job.slot))
        return ReadRequest(path=str(path), offset=offset, nbytes=nbytes, buf=buf, layer=job.layer,
                           expert=job.expert, crc32=lf.checksums[job.expert] if self._verify else None)

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        reqs = [self.request(j) for j in jobs]
        # Not abandoned on cancel: the thread writes into slot memory, so it must finish first.
        results = await trio.to_thread.run_sync(self._reader.read_batch, reqs)
        return [r.nbytes for r in results]

    def statistics(self) -> ReaderStats | None:
        return self._reader.statistics()
