"""The expert-reader seam: read requests and results, the `ExpertReader` protocol, and
buffers aligned for direct I/O.

A reader fills caller-owned buffers: the pool preallocates its slots and asks for a batch
of `(file, offset, nbytes)` ranges to land in them. The real device is `io/ssd.py`
(`SsdReader`); replay swaps in a simulated one. Design notes: docs/io.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from qnpipe.io.store_format import ALIGN, TensorSlot, aligned_len

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "ALIGN",
    "CacheMode",
    "ExpertReader",
    "ReadRequest",
    "ReadResult",
    "ReaderStats",
    "aligned_len",
    "alloc_aligned",
    "buffer_address",
    "mlx_aligned_buffer",
    "scatter_buffers",
]

# Any writable, C-contiguous object with the buffer protocol (bytearray, mmap, numpy array,
# memoryview, the host view of an evaluated mx.array: `np.asarray(arr)`), or a tuple of them.
WritableBuffer = Any


class CacheMode(enum.StrEnum):
    """How a file is opened: bypassing the OS page cache, or through it."""

    O_DIRECT = "o_direct"  # Linux: offsets, lengths and buffer addresses must be 4096-aligned
    F_NOCACHE = "f_nocache"  # macOS: no alignment rule, page-aligned buffers are fastest
    PAGE_CACHE = "page_cache"  # buffered reads (nocache=False, or the fallback)


class ReadRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Read `nbytes` bytes at byte `offset` of file `path` into `buf`.

    `buf` is caller-owned and writable: one buffer of at least `nbytes` bytes, or a tuple
    of buffers that the bytes fill in order (a scatter read, one `preadv`: e.g. a record's
    tensors straight into their slots of the pool's stacked arrays), or the same taken apart once
    by the reader's `prepare` (`qnpipe.io.ssd.Prepared`, for a destination read into often). Under direct I/O the
    bytes land in place when `offset` is a multiple of `ALIGN` and the buffers, up to
    `aligned_len(nbytes)` bytes in total (the read is rounded up; bytes past `nbytes` are
    scratch), each start at a multiple of `ALIGN` and hold a multiple of `ALIGN` bytes;
    otherwise the reader reads into an aligned bounce buffer and copies once
    (`ReaderStats.bounced_reads`). `layer` and `expert` name the record in errors (-1 =
    not an expert). `crc32` is the expected `zlib.crc32` of the `nbytes` bytes, checked
    when the reader verifies on read.
    """

    path: str
    offset: int
    nbytes: int
    buf: WritableBuffer
    layer: int = -1
    expert: int = -1
    crc32: int | None = None


class ReadResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One completed request: its `nbytes` bytes are in the request's buffer(s).

    `attempts` is 1, or 2 when the first read failed and the retry succeeded. `mode` is how
    the file was read; `bounced` says whether the bytes went through a bounce buffer.
    """

    layer: int
    expert: int
    path: str
    offset: int
    nbytes: int
    attempts: int
    mode: CacheMode
    bounced: bool
    verified: bool


class ReaderStats(msgspec.Struct, frozen=True, kw_only=True):
    """Totals since the reader opened.

    `bytes_read` counts requested bytes delivered (not the alignment padding); `read_s`
    sums the wall time of `read_batch` calls (calls from several threads overlap).
    `direct_fallbacks` counts files opened through the page cache because the file system
    refused direct I/O (EINVAL). `retries` counts reads issued again after an error, a
    short read or a checksum mismatch; `errors` the `ReadError`s raised.
    """

    backend: str  # "c" (qnpipe.io._preadx) or "python" (os.preadv in a thread pool)
    workers: int
    mode: CacheMode  # requested mode; files that fell back are counted in direct_fallbacks
    batches: int = 0
    reads: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    retries: int = 0
    errors: int = 0
    direct_fallbacks: int = 0
    bounced_reads: int = 0
    verified_reads: int = 0
    checksum_failures: int = 0


class ExpertReader(Protocol):
    """A device that reads batches of byte ranges into caller buffers (real SSD or simulated)."""

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[ReadResult]:
        """Read every request; block until all are done; results in request order.

        Blocking: call it from a worker thread (`trio.to_thread.run_sync`), never from the
        trio thread. Raises `qnpipe.errors.ReadError` naming the first expert that could not
        be read intact after one retry; no partial batch is returned. `ValueError` for a
        malformed request (negative offset, buffer too small or read-only).
        """
        ...

    def statistics(self) -> ReaderStats:
        """A snapshot of the reader's counters."""
        ...

    def close(self) -> None:
        """Release files and threads. Idempotent; `read_batch` fails afterwards."""
        ...


def buffer_address(buf: WritableBuffer) -> int:
    """Address of the first byte of a buffer-protocol object."""
    return int(np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8).ctypes.data)


def alloc_aligned(nbytes: int, *, align: int = ALIGN) -> np.ndarray:
    """A zeroed uint8 array of `aligned_len(nbytes, align)` bytes whose data address is a
    multiple of `align`: a valid direct-I/O destination for a record of `nbytes` bytes."""
    n = aligned_len(nbytes, align)
    raw = np.zeros(n + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + n]


def mlx_aligned_buffer(nbytes: int, *, align: int = ALIGN) -> tuple[mx.array, np.ndarray]:
    """Memory that MLX owns and a reader can fill in place: `(arr, host)`.

    `arr` is an evaluated uint8 `mx.array` of `aligned_len(nbytes, align)` bytes and
    `host` a writable numpy view of the same memory, its address a multiple of `align`.
    Read into `host`; `arr` (and slices / `.view(dtype)` / reshapes of it) then see the
    bytes with no copy (MLX 0.32: `np.asarray` of an evaluated array shares its memory).
    Do not write into `host` while MLX work that reads `arr` may still be running.
    """
    import mlx.core as mx

    n = aligned_len(nbytes, align)
    raw = mx.zeros((n + align,), dtype=mx.uint8)
    mx.eval(raw)
    start = -buffer_address(np.asarray(raw)) % align
    arr = raw[start : start + n]
    mx.eval(arr)
    host = np.asarray(arr)
    if not host.flags.writeable or buffer_address(host) % align:
        raise RuntimeError(f"this MLX build does not expose writable aligned array memory (start={start})")
    return arr, host


def scatter_buffers(
    tensors: Sequence[TensorSlot], record_nbytes: int, dest: Mapping[str, WritableBuffer]
) -> tuple[WritableBuffer, ...]:
    """The `ReadRequest.buf` tuple that scatters one record into per-tensor destinations.

    `dest[name]` receives tensor `name` (`TensorSlot.nbytes` bytes, e.g. the host view of
    one slot of the pool's stacked array for that tensor). Gaps between tensors get scratch
    buffers, and so does the tail up to `aligned_len(record_nbytes)`, so the tuple covers the
    whole direct-I/O read. When every tensor size is a multiple of `ALIGN` (the 80B model's
    records: 512 KiB and 32 KiB tensors) and the destinations are aligned, the read lands in
    place with no copy; otherwise the reader bounces and copies once.
    """
    out: list[WritableBuffer] = []
    pos = 0
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset < pos:
            raise ValueError(f"tensor {t.name} at offset {t.offset} overlaps the previous one (ends at {pos})")
        if t.offset > pos:
            out.append(bytearray(t.offset - pos))
        buf = dest[t.name]
        if memoryview(buf).nbytes < t.nbytes:
            raise ValueError(f"destination of {t.name} holds {memoryview(buf).nbytes} bytes < {t.nbytes}")
        out.append(memoryview(buf).cast("B")[: t.nbytes])
        pos = t.offset + t.nbytes
    if pos > record_nbytes:
        raise ValueError(f"tensors end at {pos}, past record_nbytes {record_nbytes}")
    if aligned_len(record_nbytes) > pos:
        tail = aligned_len(record_nbytes) - pos
        out.append(alloc_aligned(tail) if pos % ALIGN == 0 else bytearray(tail))
    return tuple(out)
