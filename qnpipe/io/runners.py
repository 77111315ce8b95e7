"""The reader's two ways to run a batch of preads: the C extension's pthread pool, or Python threads.

Both take the same ops and give the same results (bytes read, or -errno per op); the C pool can
also take a batch without waiting for it (`submit`: qnpipe.io.ssd.SsdReader.start).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

try:
    import qnpipe.io._preadx as _preadx
except ImportError:  # the optional extension was not built (no compiler at install time)
    _preadx = None


# os.preadv's signature: (fd, buffers, offset) -> bytes read; raises OSError. The Python
# backend's hook (tests inject faults with it).
PreadvFn = Callable[[int, list[memoryview], int], int]


def c_extension_available() -> bool:
    """Whether `qnpipe.io._preadx` was built and imports."""
    return _preadx is not None


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """`bufs` without their first `n` bytes (after a partial read)."""
    out = list(bufs)
    while out and n >= out[0].nbytes:
        n -= out.pop(0).nbytes
    if out and n:
        out[0] = out[0][n:]
    return out



# One read: (fd, offset, need, buffers). Fill `buffers` (one memoryview, or a tuple of them
# for a scatter read) from `offset`; done once `need` bytes arrived. Result: bytes read, or
# -errno. The C extension takes exactly these tuples.
Op = tuple[int, int, int, "memoryview | tuple[memoryview, ...]"]


class Runner(Protocol):
    def run(self, ops: Sequence[Op]) -> list[int]: ...
    def close(self) -> None: ...


class CRunner:
    def __init__(self, workers: int) -> None:
        assert _preadx is not None
        self._pool = _preadx.Pool(workers)

    def run(self, ops: Sequence[Op]) -> list[int]:
        return self._pool.pread_batch(ops)

    def submit(self, ops: Sequence[tuple[object, ...]], notify_fd: int) -> CBatch:
        return self._pool.submit(ops, notify_fd)

    def close(self) -> None:
        self._pool.close()


class PyRunner:
    def __init__(self, workers: int, preadv: PreadvFn) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="qnpipe-pread")
        self._preadv = preadv

    def run(self, ops: Sequence[Op]) -> list[int]:
        futures = [self._pool.submit(self._one, op) for op in ops]
        return [f.result() for f in futures]

    def _one(self, op: Op) -> int:
        fd, offset, need, buffers = op
        bufs = list(buffers) if isinstance(buffers, tuple) else [buffers]
        got = 0
        while got < need and bufs:
            try:
                n = self._preadv(fd, bufs, offset + got)
            except OSError as exc:
                return -(exc.errno or errno.EIO)
            if n <= 0:
                break  # EOF
            got += n
            bufs = _advance(bufs, n)
        return got

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CBatch(Protocol):
    """`qnpipe.io._preadx.Batch`: a batch `Pool.submit` queued."""

    @property
    def t_done(self) -> float: ...
    @property
    def t_started(self) -> float: ...
    def wait(self) -> list[int]: ...



__all__ = ["CBatch", "CRunner", "Op", "PreadvFn", "PyRunner", "Runner", "c_extension_available"]
