"""Writing an output directory atomically, with a byte progress bar.

Everything goes into a locked temporary sibling (`.NAME.qnpipe-tmp-PID-XXXX/model`) that is
renamed onto the output at the end. Errors, SIGINT and SIGTERM remove it; a run killed
with SIGKILL leaves it behind with a free lock, and the next run removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TMP_TAG = ".qnpipe-tmp-"
Log = Callable[[str], None]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def peak_rss() -> int:
    """Peak resident set size of this process in bytes."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_location(out: Path, what: str = "output directory") -> Path:
    """Check that directory `out` can be created (or replaced); returns its nearest existing ancestor.

    Creates and removes a probe directory there, so read-only file systems, permissions and
    virtual file systems (/proc, /sys) are found before any work. Raises OutputError naming
    the path and the reason.
    """
    from qnpipe.errors import OutputError

    out = Path(out)
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise OutputError(f"{what} {out}: {existing} is not a directory")
    probe = existing / f".qnpipe-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno in (errno.ENOENT, errno.EPERM, errno.ENOTDIR) and existing.is_dir():
            reason = f"{reason}: directories cannot be created in {existing} (a virtual file system like /proc?)"
        elif e.errno == errno.EROFS:
            reason = f"{existing} is on a read-only file system"
        elif e.errno == errno.EACCES:
            reason = f"no permission to write in {existing}"
        raise OutputError(f"{what} {out}: cannot write there ({reason})") from None
    probe.rmdir()
    return existing


def clean_stale(parent: Path, name: str, log: Log) -> None:
    """Remove temporary directories of interrupted runs writing `name` (their lock is free)."""
    for d in parent.glob(f".{name}{TMP_TAG}*"):
        if not d.is_dir():
            continue
        lock = d / ".lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            if time.time() - d.stat().st_mtime < 60:  # just created, not locked yet
                continue
            fd = -1
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # another run is writing it
        finally:
            if fd >= 0:
                os.close(fd)
        log(f"removing {d} (left by an interrupted run)")
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) (SIGINT already raises KeyboardInterrupt), so `finally` cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a fresh build directory that replaces `out` when the block succeeds.

    `out`'s parent must exist. On any exception (or SIGINT/SIGTERM) the build directory is
    removed and `out` is left as it was.
    """
    parent = out.parent
    tmp = parent / f".{out.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lock_fd = -1
    with signals_raise():
        try:
            tmp.mkdir()
            lock_fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # a later run removes tmp only once this is released
            build = tmp / "model"
            build.mkdir()
            yield build
            with signals_blocked():
                if out.exists():
                    out.rename(tmp / "old")
                build.rename(out)
                fsync_dir(parent)
        finally:
            with signals_blocked():  # a second Ctrl-C must not interrupt the cleanup
                if lock_fd >= 0:
                    os.close(lock_fd)
                shutil.rmtree(tmp, ignore_errors=True)


class ByteProgress:
    """A rich progress bar in bytes with speed and ETA, on stderr; does nothing when disabled."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.p: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                              TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.p.add_task(what, total=total)
            self.p.start()

    def advance(self, n: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, n)

    def describe(self, what: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=what)

    def stop(self) -> None:
        if self.p is not None:
            self.p.stop()
