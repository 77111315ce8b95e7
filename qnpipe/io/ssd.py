"""`SsdReader`: the real expert reader (page-cache bypass, N reads in flight).

Files open with O_DIRECT on Linux and F_NOCACHE on macOS (`nocache=True`), or through
the page cache. A file system that refuses O_DIRECT (EINVAL, e.g. tmpfs) gets a buffered
fallback, counted in `statistics().direct_fallbacks`. A batch runs on the C extension
`qnpipe.io._preadx` (pthreads, GIL released) when it is built, else on `os.preadv` in a
`ThreadPoolExecutor`; both read straight into the caller's buffers. Design: docs/io.md.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from qnpipe.config.tree import ReadBackend
from qnpipe.errors import ReadError
from qnpipe.io.reader import (
    ALIGN,
    CacheMode,
    ReaderStats,
    ReadRequest,
    ReadResult,
    aligned_len,
    alloc_aligned,
    buffer_address,
)

if TYPE_CHECKING:
    from qnpipe.config import ReadCfg

__all__ = ["PreadvFn", "SsdReader", "c_extension_available", "choose_backend", "nocache_mode"]

try:
    import qnpipe.io._preadx as _preadx
except ImportError:  # the optional extension was not built (no compiler at install time)
    _preadx = None

_F_NOCACHE_DARWIN = 48  # <sys/fcntl.h>; Python's fcntl module has no name for it before 3.13

# os.preadv's signature: (fd, buffers, offset) -> bytes read; raises OSError. The Python
# backend's hook (tests inject faults with it).
PreadvFn = Callable[[int, list[memoryview], int], int]


def c_extension_available() -> bool:
    """Whether `qnpipe.io._preadx` was built and imports."""
    return _preadx is not None


def choose_backend(backend: ReadBackend | str, *, hooked: bool, c_available: bool) -> ReadBackend:
    """The backend a reader runs: `backend`, with AUTO resolved; a `preadv` hook (`hooked`) means Python.

    Raises:
      ValueError: C was asked for with a hook, or without the extension (`c_available` false).
    """
    backend = ReadBackend(backend)
    if hooked:
        if backend is ReadBackend.C:
            raise ValueError("preadv= is a hook of the Python backend; it cannot be used with backend='c'")
        return ReadBackend.PYTHON
    if backend is ReadBackend.AUTO:
        return ReadBackend.C if c_available else ReadBackend.PYTHON
    if backend is ReadBackend.C and not c_available:
        raise ValueError("backend='c' but the C extension qnpipe.io._preadx is not built")
    return backend


def nocache_mode(nocache: bool, platform: str = sys.platform) -> CacheMode:
    """The page-cache bypass this platform offers (`PAGE_CACHE` when `nocache` is off)."""
    if not nocache:
        return CacheMode.PAGE_CACHE
    if platform == "darwin":
        return CacheMode.F_NOCACHE
    if platform.startswith("linux") and hasattr(os, "O_DIRECT"):
        return CacheMode.O_DIRECT
    return CacheMode.PAGE_CACHE


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """`bufs` without their first `n` bytes (after a partial read)."""
    out = list(bufs)
    while out and n >= out[0].nbytes:
        n -= out.pop(0).nbytes
    if out and n:
        out[0] = out[0][n:]
    return out


class _OpenFile(msgspec.Struct, frozen=True, gc=False):
    fd: int
    mode: CacheMode


# One read: (fd, offset, need, buffers). Fill `buffers` (one memoryview, or a tuple of them
# for a scatter read) from `offset`; done once `need` bytes arrived. Result: bytes read, or
# -errno. The C extension takes exactly these tuples.
_Op = tuple[int, int, int, "memoryview | tuple[memoryview, ...]"]


class _Runner(Protocol):
    def run(self, ops: Sequence[_Op]) -> list[int]: ...
    def close(self) -> None: ...


class _CRunner:
    def __init__(self, workers: int) -> None:
        assert _preadx is not None
        self._pool = _preadx.Pool(workers)

    def run(self, ops: Sequence[_Op]) -> list[int]:
        return self._pool.pread_batch(ops)

    def close(self) -> None:
        self._pool.close()


class _PyRunner:
    def __init__(self, workers: int, preadv: PreadvFn) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="qnpipe-pread")
        self._preadv = preadv

    def run(self, ops: Sequence[_Op]) -> list[int]:
        futures = [self._pool.submit(self._one, op) for op in ops]
        return [f.result() for f in futures]

    def _one(self, op: _Op) -> int:
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


class _ReadPlan(msgspec.Struct, gc=False):
    """How one request is read: straight into its buffer(s), or via an aligned bounce buffer."""

    op: _Op
    dest: tuple[memoryview, ...]  # the caller's buffer(s) as bytes, trimmed to nbytes in total
    skip: int  # bytes of the read before the request's first byte (bounce only)
    bounce: np.ndarray | None
    mode: CacheMode


class SsdReader:
    """The real `ExpertReader`: reads batches of byte ranges into caller buffers.

    `workers` preads are in flight at most (shared by concurrent `read_batch` calls, which
    queue FIFO). `nocache` bypasses the page cache (O_DIRECT / F_NOCACHE). `verify_crc32`
    checks each request that carries a `crc32` after reading. `backend` picks the C
    extension or the Python thread pool (`AUTO`: C when built). `preadv` replaces the Python
    backend's `os.preadv` (fault injection in tests) and implies `ReadBackend.PYTHON`.
    Thread-safe; `close()` (or the context manager) releases files and threads.
    """

    def __init__(
        self,
        *,
        workers: int = 8,
        nocache: bool = True,
        verify_crc32: bool = False,
        backend: ReadBackend | str = ReadBackend.AUTO,
        preadv: PreadvFn | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        backend = choose_backend(backend, hooked=preadv is not None, c_available=c_extension_available())
        self._runner: _Runner = (
            _CRunner(workers) if backend is ReadBackend.C else _PyRunner(workers, preadv or os.preadv)
        )
        self._mode = nocache_mode(nocache)
        self._verify = verify_crc32
        self._files: dict[str, _OpenFile] = {}
        self._retired_fds: list[int] = []  # replaced by a fallback; closed at close()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = ReaderStats(backend=backend.value, workers=workers, mode=self._mode)

    @classmethod
    def from_config(cls, read_cfg: ReadCfg, **kwargs: object) -> SsdReader:
        """A reader configured by `read_cfg` (workers, nocache, verify_crc32, backend); `kwargs` as in `__init__` win."""
        base: dict[str, object] = {"workers": read_cfg.workers, "nocache": read_cfg.nocache,
                                   "verify_crc32": read_cfg.verify_crc32, "backend": str(read_cfg.backend)}
        return cls(**{**base, **kwargs})  # type: ignore[arg-type]

    # ------------------------------------------------------------------ public

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[ReadResult]:
        """Read every request into its buffer; block until all are done.

        Results come in request order. A failed read (OSError, short read, checksum
        mismatch) is issued once more; if it fails again, `ReadError` names the first such
        expert (layer, expert, file, offset) and no results are returned (the buffers'
        contents are then undefined). Raises `ValueError` for a malformed request and
        `RuntimeError` after `close()`.
        """
        if self._closed:
            raise RuntimeError("SsdReader is closed")
        if not requests:
            return []
        t0 = time.perf_counter()
        plans = [self._plan(r) for r in requests]
        attempts = [1] * len(plans)
        verified = crc_failures = 0

        def run(which: Sequence[int]) -> dict[int, str]:
            nonlocal verified, crc_failures
            failed = self._execute(plans, which, requests)
            if self._verify:
                for i in which:
                    r = requests[i]
                    if i in failed or r.crc32 is None:
                        continue
                    verified += 1
                    got = _crc32(plans[i].dest)
                    if got != r.crc32:
                        crc_failures += 1
                        failed[i] = f"crc32 mismatch: the index says {r.crc32:#010x}, the bytes read give {got:#010x}"
            return failed

        # Everything that failed is read once more (a re-read cures a transient I/O error or
        # a bad transfer); what fails twice is an error.
        first = run(range(len(plans)))
        second: dict[int, str] = {}
        if first:
            for i in first:
                attempts[i] = 2
            second = run(sorted(first))
        bounced = sum(p.bounce is not None for p in plans)
        self._add_stats(
            t0, requests=0 if second else len(requests),
            nbytes=0 if second else sum(r.nbytes for r in requests), retries=len(first),
            bounced=0 if second else bounced, verified=verified, crc_failures=crc_failures, errors=int(bool(second)),
        )
        if second:
            i = min(second)
            r = requests[i]
            raise ReadError(
                f"{second[i]} (after one retry; first attempt: {first[i]})",
                layer=r.layer, expert=r.expert, path=r.path, offset=r.offset, nbytes=r.nbytes,
            )
        return [
            ReadResult(
                layer=r.layer, expert=r.expert, path=r.path, offset=r.offset, nbytes=r.nbytes,
                attempts=a, mode=p.mode, bounced=p.bounce is not None, verified=self._verify and r.crc32 is not None,
            )
            for r, p, a in zip(requests, plans, attempts, strict=True)
        ]

    def statistics(self) -> ReaderStats:
        """A snapshot of the counters (see `ReaderStats`)."""
        with self._lock:
            return self._stats

    @property
    def backend(self) -> ReadBackend:
        """The backend in use (never `AUTO`)."""
        return ReadBackend(self._stats.backend)

    def close(self) -> None:
        """Stop the worker threads and close every file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds = [f.fd for f in self._files.values()] + self._retired_fds
            self._files.clear()
            self._retired_fds.clear()
        self._runner.close()
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> SsdReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _file(self, path: str) -> _OpenFile:
        f = self._files.get(path)
        if f is not None:
            return f
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._open(path, self._mode)
                self._files[path] = f
        return f

    def _open(self, path: str, mode: CacheMode) -> _OpenFile:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if mode is CacheMode.O_DIRECT:
            try:
                return _OpenFile(os.open(path, flags | os.O_DIRECT), CacheMode.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._count_fallback()
                return _OpenFile(os.open(path, flags), CacheMode.PAGE_CACHE)
        fd = os.open(path, flags)
        if mode is CacheMode.F_NOCACHE:
            import fcntl

            try:
                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE_DARWIN), 1)
            except OSError:
                self._count_fallback()
                return _OpenFile(fd, CacheMode.PAGE_CACHE)
        return _OpenFile(fd, mode)

    def _count_fallback(self) -> None:
        # Always called with self._lock held.
        self._stats = msgspec.structs.replace(self._stats, direct_fallbacks=self._stats.direct_fallbacks + 1)

    def _reopen_buffered(self, path: str, fd: int) -> None:
        """The file system refused a direct read of `path` on `fd` (EINVAL): use the page cache."""
        with self._lock:
            f = self._files.get(path)
            if f is not None and f.fd == fd and f.mode is CacheMode.O_DIRECT:
                self._files[path] = self._open(path, CacheMode.PAGE_CACHE)
                self._retired_fds.append(fd)
                self._count_fallback()

    def _plan(self, r: ReadRequest) -> _ReadPlan:
        if r.offset < 0 or r.nbytes <= 0:
            raise ValueError(f"bad read request: offset {r.offset}, nbytes {r.nbytes} ({r.path})")
        segs = _segments(r)
        f = self._file(r.path)
        if f.mode is not CacheMode.O_DIRECT:
            dest = _trim(segs, r.nbytes)
            return _ReadPlan((f.fd, r.offset, r.nbytes, _one_or_tuple(dest)), dest, 0, None, f.mode)
        # Direct I/O reads whole 4096-byte blocks into 4096-aligned memory: read in place when
        # every buffer (trimmed to the rounded-up length) is a whole number of aligned blocks.
        length = aligned_len(r.nbytes)
        if r.offset % ALIGN == 0 and sum(m.nbytes for m in segs) >= length:
            direct = _trim(segs, length)
            if all(m.nbytes % ALIGN == 0 and buffer_address(m) % ALIGN == 0 for m in direct):
                return _ReadPlan((f.fd, r.offset, r.nbytes, _one_or_tuple(direct)), _trim(segs, r.nbytes), 0, None,
                             f.mode)
        skip = r.offset % ALIGN
        bounce = alloc_aligned(skip + r.nbytes)
        op = (f.fd, r.offset - skip, skip + r.nbytes, bounce.data)
        return _ReadPlan(op, _trim(segs, r.nbytes), skip, bounce, f.mode)

    def _execute(self, plans: list[_ReadPlan], which: Sequence[int], requests: Sequence[ReadRequest]) -> dict[int, str]:
        """Run the preads of `plans[which]` and copy bounced bytes home; {index: why} of failures."""
        out = self._runner.run([plans[i].op for i in which])
        failed: dict[int, str] = {}
        refused: list[int] = []
        for i, res in zip(which, out, strict=True):
            p = plans[i]
            nbytes = requests[i].nbytes
            if res == -errno.EINVAL and p.mode is CacheMode.O_DIRECT:
                refused.append(i)
            elif res < 0:
                failed[i] = f"{errno.errorcode.get(-res, 'errno ' + str(-res))}: {os.strerror(-res)}"
            elif res < p.op[2]:
                failed[i] = f"short read: {max(res - p.skip, 0)} of {nbytes} bytes, then end of file"
            elif p.bounce is not None:
                pos = p.skip
                for m in p.dest:  # scatter the bounced bytes home
                    m[:] = p.bounce[pos : pos + m.nbytes].data
                    pos += m.nbytes
        if refused:
            # The file system took O_DIRECT at open but refuses it at read: go buffered.
            for i in refused:
                self._reopen_buffered(requests[i].path, plans[i].op[0])
                plans[i] = self._plan(requests[i])
            failed.update(self._execute(plans, refused, requests))
        return failed

    def _add_stats(
        self, t0: float, *, requests: int, nbytes: int, retries: int, bounced: int, verified: int,
        crc_failures: int, errors: int,
    ) -> None:
        dt = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            self._stats = msgspec.structs.replace(
                s, batches=s.batches + 1, reads=s.reads + requests, bytes_read=s.bytes_read + nbytes,
                read_s=s.read_s + dt, retries=s.retries + retries, errors=s.errors + errors,
                bounced_reads=s.bounced_reads + bounced, verified_reads=s.verified_reads + verified,
                checksum_failures=s.checksum_failures + crc_failures,
            )


def _segments(r: ReadRequest) -> list[memoryview]:
    """The request's destination buffer(s) as writable byte views; ValueError if unusable."""
    bufs = r.buf if isinstance(r.buf, tuple | list) else (r.buf,)
    out = []
    for b in bufs:
        try:
            m = memoryview(b).cast("B")
        except TypeError as exc:
            raise ValueError(f"request buffer for {r.path}@{r.offset} is not a contiguous buffer: {exc}") from None
        if m.readonly:
            raise ValueError(f"request buffer for {r.path}@{r.offset} is read-only")
        out.append(m)
    room = sum(m.nbytes for m in out)
    if not out or room < r.nbytes:
        raise ValueError(f"request buffers for {r.path}@{r.offset} hold {room} bytes < nbytes {r.nbytes}")
    return out


def _trim(segs: list[memoryview], n: int) -> tuple[memoryview, ...]:
    """The first `n` bytes of `segs`, as views (empty tails dropped)."""
    out = []
    for m in segs:
        if n <= 0:
            break
        out.append(m[:n] if m.nbytes > n else m)
        n -= out[-1].nbytes
    return tuple(out)


def _one_or_tuple(segs: tuple[memoryview, ...]) -> memoryview | tuple[memoryview, ...]:
    return segs[0] if len(segs) == 1 else segs


def _crc32(segs: tuple[memoryview, ...]) -> int:
    crc = 0
    for m in segs:
        crc = zlib.crc32(m, crc)
    return crc
