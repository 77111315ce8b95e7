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
from typing import TYPE_CHECKING

import msgspec

from qnpipe.config.tree import ReadBackend
from qnpipe.errors import ReadError
from qnpipe.io.destination import Prepared, one_or_tuple, prepare
from qnpipe.io.pending import PendingRead
from qnpipe.io.read_plan import ReadPlan, Target
from qnpipe.io.reader import (
    ALIGN,
    CacheMode,
    ReaderStats,
    ReadRequest,
    ReadResult,
    WritableBuffer,
    alloc_aligned,
)
from qnpipe.io.runners import CRunner, PreadvFn, PyRunner, Runner, c_extension_available

if TYPE_CHECKING:
    from qnpipe.config import ReadCfg

__all__ = ["PendingRead", "Prepared", "PreadvFn", "SsdReader", "Target", "prepare", "c_extension_available", "choose_backend", "nocache_mode"]

_F_NOCACHE_DARWIN = 48  # <sys/fcntl.h>; Python's fcntl module has no name for it before 3.13

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


class _OpenFile(msgspec.Struct, frozen=True, gc=False):
    fd: int
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
        self._runner: Runner = (
            CRunner(workers) if backend is ReadBackend.C else PyRunner(workers, preadv or os.preadv)
        )
        self._mode = nocache_mode(nocache)
        self._verify = verify_crc32
        self._files: dict[str, _OpenFile] = {}
        self._retired_fds: list[int] = []  # replaced by a fallback; closed at close()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = ReaderStats(backend=backend.value, workers=workers, mode=self._mode)
        # Counted per batch in plain ints: a `ReaderStats` rebuilt per batch cost ~12 µs on the path from a demand
        # batch's end to its grant (docs/measurements.md); `statistics` builds the snapshot.
        self._tally = _Tally()
        self.epoch = 0  # bumped when a file is reopened through the page cache (a `Target` of before is stale)

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
        return self._conclude(requests, plans, attempts, first, second, time.perf_counter() - t0,
                              verified=verified, crc_failures=crc_failures)

    @staticmethod
    def prepare(buf: WritableBuffer, nbytes: int, where: str = "a read") -> Prepared:
        """`buf` as a destination for many reads of `nbytes` bytes (`ReadRequest.buf`; module `prepare`)."""
        return prepare(buf, nbytes, where)

    @property
    def starts(self) -> bool:
        """Whether `start` is offered: the C backend, not verifying checksums (which `read_batch` does)."""
        return isinstance(self._runner, CRunner) and not self._verify

    def start(self, requests: Sequence[ReadRequest], notify_fd: int) -> PendingRead:
        """Put `requests` on the device now and return at once: no thread of the caller's waits for them.

        When the reads are done the reader writes an 8-byte 1 to `notify_fd` (an eventfd, or a pipe's
        write end); the caller reads those 8 bytes and calls `PendingRead.poll`, which gives the
        results as `read_batch` would, or None after putting a retry on the device (the fd is written
        again). Bounced bytes are copied home by the reader's threads. Only when `starts`.
        """
        if self._closed:
            raise RuntimeError("SsdReader is closed")
        if not self.starts:
            raise RuntimeError("SsdReader.start needs the C backend without verify_crc32 (see `starts`)")
        return PendingRead(self, requests, notify_fd)

    def target(self, path: str, prep: Prepared) -> Target | None:
        """`path` and the destination `prep` planned once for `start_at`, or None when a direct read would
        not land in place (it is bounced: `start` plans each such read)."""
        epoch = self.epoch  # first: a fallback in between leaves the target stale, not wrong
        f = self._file(path)
        if f.mode is CacheMode.O_DIRECT:
            if prep.direct is None:
                return None
            return Target(f.fd, one_or_tuple(prep.direct), prep.dest, f.mode, prep.nbytes, epoch)
        return Target(f.fd, one_or_tuple(prep.dest), prep.dest, f.mode, prep.nbytes, epoch)

    def start_at(self, reads: Sequence[tuple[Target, int]], notify_fd: int,
                 requests: Callable[[], Sequence[ReadRequest]]) -> PendingRead:
        """`start` of reads given as (target, offset) pairs, with no request or plan built per read; `requests()`
        gives the same reads as `ReadRequest`s and is called only when one of them fails. A stale target or an
        offset a direct read cannot take in place sends the whole batch through `start`."""
        if self._closed:
            raise RuntimeError("SsdReader is closed")
        if not self.starts:
            raise RuntimeError("SsdReader.start_at needs the C backend without verify_crc32 (see `starts`)")
        epoch = self.epoch
        for t, offset in reads:
            if t.epoch != epoch or offset < 0 or (t.mode is CacheMode.O_DIRECT and offset % ALIGN):
                return PendingRead(self, requests(), notify_fd)
        return PendingRead(self, requests, notify_fd, at=reads)

    def _conclude(self, requests: Sequence[ReadRequest], plans: list[ReadPlan], attempts: list[int],
                  first: dict[int, str], second: dict[int, str], dt: float, *, verified: int = 0,
                  crc_failures: int = 0) -> list[ReadResult]:
        """Count the batch; its results, or `ReadError` for what failed twice."""
        bounced = sum(p.bounce is not None for p in plans)
        self._add_stats(
            dt, requests=0 if second else len(requests),
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
            return self._tally.into(self._stats)

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
        self._tally.direct_fallbacks += 1

    def _reopen_buffered(self, path: str, fd: int) -> None:
        """The file system refused a direct read of `path` on `fd` (EINVAL): use the page cache."""
        with self._lock:
            f = self._files.get(path)
            if f is not None and f.fd == fd and f.mode is CacheMode.O_DIRECT:
                self._files[path] = self._open(path, CacheMode.PAGE_CACHE)
                self._retired_fds.append(fd)
                self._count_fallback()
                self.epoch += 1

    def _plan(self, r: ReadRequest) -> ReadPlan:
        if r.offset < 0 or r.nbytes <= 0:
            raise ValueError(f"bad read request: offset {r.offset}, nbytes {r.nbytes} ({r.path})")
        prep = r.buf
        if not isinstance(prep, Prepared):
            prep = prepare(prep, r.nbytes, f"{r.path}@{r.offset}")
        elif prep.nbytes != r.nbytes:
            raise ValueError(f"read of {r.nbytes} bytes into a destination prepared for {prep.nbytes} ({r.path})")
        f = self._file(r.path)
        if f.mode is not CacheMode.O_DIRECT:
            return ReadPlan((f.fd, r.offset, r.nbytes, one_or_tuple(prep.dest)), prep.dest, 0, None, f.mode)
        if r.offset % ALIGN == 0 and prep.direct is not None:
            return ReadPlan((f.fd, r.offset, r.nbytes, one_or_tuple(prep.direct)), prep.dest, 0, None, f.mode)
        skip = r.offset % ALIGN
        bounce = alloc_aligned(skip + r.nbytes)
        op = (f.fd, r.offset - skip, skip + r.nbytes, bounce.data)
        return ReadPlan(op, prep.dest, skip, bounce, f.mode)

    def _execute(self, plans: list[ReadPlan], which: Sequence[int], requests: Sequence[ReadRequest]) -> dict[int, str]:
        """Run the preads of `plans[which]` and copy bounced bytes home; {index: why} of failures."""
        out = self._runner.run([plans[i].op for i in which])
        failed, refused = self._outcome(plans, which, out, requests, copied=False)
        if refused:
            failed.update(self._execute(plans, refused, requests))
        return failed

    def _outcome(self, plans: list[ReadPlan], which: Sequence[int], out: list[int], requests: Sequence[ReadRequest],
                 *, copied: bool) -> tuple[dict[int, str], list[int]]:
        """Judge the results `out` of `plans[which]`: ({index: why} of failures, the reads to issue again
        buffered). Bounced bytes are copied home here unless the reader's threads did (`copied`)."""
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
            elif p.bounce is not None and not copied:
                pos = p.skip
                for m in p.dest:  # scatter the bounced bytes home
                    m[:] = p.bounce[pos : pos + m.nbytes].data
                    pos += m.nbytes
        # The file system took O_DIRECT at open but refuses it at read: go buffered.
        for i in refused:
            self._reopen_buffered(requests[i].path, plans[i].op[0])
            plans[i] = self._plan(requests[i])
        return failed, refused

    def _add_stats(
        self, dt: float, *, requests: int, nbytes: int, bounced: int, retries: int = 0, verified: int = 0,
        crc_failures: int = 0, errors: int = 0,
    ) -> None:
        with self._lock:
            t = self._tally
            t.batches += 1
            t.reads += requests
            t.bytes_read += nbytes
            t.read_s += dt
            t.retries += retries
            t.errors += errors
            t.bounced_reads += bounced
            t.verified_reads += verified
            t.checksum_failures += crc_failures


class _Tally:
    """`ReaderStats`' counters, bumped in place (under the reader's lock)."""

    __slots__ = ("batches", "bounced_reads", "bytes_read", "checksum_failures", "direct_fallbacks", "errors",
                 "read_s", "reads", "retries", "verified_reads")

    def __init__(self) -> None:
        self.batches = self.reads = self.bytes_read = self.retries = self.errors = self.direct_fallbacks = 0
        self.bounced_reads = self.verified_reads = self.checksum_failures = 0
        self.read_s = 0.0

    def into(self, base: ReaderStats) -> ReaderStats:
        return msgspec.structs.replace(base, **{k: getattr(self, k) for k in self.__slots__})


def _crc32(segs: tuple[memoryview, ...]) -> int:
    crc = 0
    for m in segs:
        crc = zlib.crc32(m, crc)
    return crc
