"""Writing an output directory atomically, with a byte progress bar.

Everything goes into a locked temporary sibling (`.NAME.qnpipe-tmp-PID-XXXX/model`) that
takes the output's place at the end: swapped with an existing output in one step where the
system can (renameat2 RENAME_EXCHANGE, macOS renamex_np), else the old output is first
renamed into the temporary directory. Errors, SIGINT and SIGTERM remove the temporary
directory; a run killed with SIGKILL leaves it behind with a free lock, and the next run
removes it, after putting back an old output a replace had moved aside (clean_stale).

What `--force` may replace is checked first (check_replaceable): only a directory qnpipe
wrote (its MARKER), never the working directory, a file or someone else's directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
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

from qnpipe.errors import OutputError, QnpipeError

TMP_TAG = ".qnpipe-tmp-"
MARKER = ".qnpipe-output"  # in every directory atomic_dir wrote with a marker: what --force may replace
OLD = "old"  # in a temporary directory: the output a replace moved aside, to put back if it was cut short
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


def output_path(out: str | os.PathLike[str]) -> Path:
    """`out` made absolute: symlinks resolved in its parent, and `.`, `..` or `/` resolved whole.

    The last component stays as given otherwise, so a symbolic link named OUT is seen as one
    (check_replaceable refuses it) instead of being followed.
    """
    p = Path(out).absolute()  # "." is the working directory itself; ".." stays a component
    if p.name in ("", ".."):
        return p.resolve()
    return p.parent.resolve() / p.name


def is_qnpipe_output(d: Path) -> bool:
    """True for a directory qnpipe wrote: its MARKER, or the experts/index.json or config.json `qnpipe`
    section of a convert output made before the marker existed."""
    from qnpipe.io.files import CONFIG_CAP, read_capped

    if (d / MARKER).is_file() or (d / "experts" / "index.json").is_file():
        return True
    try:
        config = json.loads(read_capped(d / "config.json", CONFIG_CAP))
    except (QnpipeError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("qnpipe"), dict)


def check_replaceable(out: Path, force: bool, what: str, force_flag: str = "--force") -> None:
    """Refuse an `out` (from output_path) that qnpipe must not write or replace, before any work.

    Never replaced, even with `force`: the working directory or one that contains it (`--out .`
    or `..`), a symbolic link, something that is not a directory, and a non-empty directory
    that qnpipe did not write (is_qnpipe_output). A non-empty qnpipe output is replaced only
    with `force`. Raises OutputError naming `out`, or FileExistsError (the one `force` answers).
    """
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory was removed: nothing of it to protect
        cwd = None
    if not out.name or (cwd is not None and (out == cwd or out in cwd.parents)):
        raise OutputError(f"{what} {out} is the current directory or contains it: qnpipe writes a new directory "
                          f"and renames it into place, so give one that does not hold the current directory (e.g. ./model)")
    if out.is_symlink():
        raise OutputError(f"{what} {out} is a symbolic link (to {os.readlink(out)}): qnpipe would replace the link, "
                          f"not the directory it points to; give the target's path or another one")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{what} {out} exists and is not a directory: qnpipe replaces only a directory it wrote; "
                          f"remove it yourself or give another path")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise OutputError(f"{what} {out}: cannot list it ({e.strerror or e})") from None
    if empty:
        return
    if not force:
        raise FileExistsError(f"{out} exists and is not empty (pass {force_flag} to replace it)")
    if not is_qnpipe_output(out):
        raise OutputError(f"{what} {out} is not empty and is not a qnpipe output (no {MARKER}, experts/index.json "
                          f"or config.json `qnpipe` section): qnpipe replaces only a directory it wrote, even with "
                          f"--force; remove it yourself or give another path")


@contextlib.contextmanager
def _stale_lock(d: Path) -> Iterator[bool]:
    """Hold the lock of the temporary directory `d`; yields False when a live run holds it (or may soon)."""
    try:
        fd = os.open(d / ".lock", os.O_RDWR)
    except FileNotFoundError:
        yield time.time() - d.stat().st_mtime >= 60  # a run creates it just after the directory
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def clean_stale(parent: Path, name: str, log: Log) -> None:
    """Finish what interrupted runs writing `parent/name` left (their lock is free).

    A run killed between the two renames of a replace (atomic_dir without RENAME_EXCHANGE)
    left the previous output in its temporary directory as OLD and nothing at `name`: it is
    renamed back first. The rest of such a directory (a half-written build, or a previous
    output already replaced) is removed. When `name` exists again, OLD may be the only copy
    of what it held: it is kept and reported, never removed.
    """
    out = parent / name
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return
    for d in entries:
        if not d.name.startswith(f".{name}{TMP_TAG}") or d.is_symlink() or not d.is_dir():
            continue
        with _stale_lock(d) as free:
            if not free:
                continue  # another run is writing it
            old = d / OLD
            if os.path.lexists(old):
                if os.path.lexists(out):
                    log(f"warning: {old} holds an earlier {out}, moved aside by an interrupted run; {out} exists "
                        f"now, so it is kept: remove it yourself once you have checked {out}")
                    continue
                os.rename(old, out)
                fsync_dir(parent)
                log(f"restored {out} from {old} (a replace was interrupted between its two steps)")
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


_RENAME_EXCHANGE = 2  # linux/fs.h; macOS's RENAME_SWAP has the same value
_AT_FDCWD = -100
_swap_fn: Any = None


def _swap() -> Any:
    """libc's atomic swap of two paths (renameat2 on Linux, renamex_np on macOS), or False."""
    global _swap_fn
    if _swap_fn is None:
        _swap_fn = False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return _swap_fn
        if (fn := getattr(libc, "renameat2", None)) is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _swap_fn = lambda a, b: fn(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)  # noqa: E731
        elif (fn := getattr(libc, "renamex_np", None)) is not None:
            fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            _swap_fn = lambda a, b: fn(a, b, _RENAME_EXCHANGE)  # noqa: E731
    return _swap_fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one atomic step; False when the system or file system cannot."""
    fn = _swap()
    if not fn:
        return False
    if fn(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _put_in_place(build: Path, out: Path, tmp: Path) -> None:
    """Make `build` the directory `out`, with no moment in which a crash leaves neither version.

    Swapped in one step where the system can (the old output then sits in `tmp`, removed with
    it). Otherwise the old output is renamed to `tmp/OLD` first: a crash before the second
    rename leaves it there whole, and the next run's clean_stale renames it back.
    """
    if not os.path.lexists(out):
        os.rename(build, out)
    elif not _exchange(build, out):
        os.rename(out, tmp / OLD)
        os.rename(build, out)
        with contextlib.suppress(OSError):  # OLD means "put me back": no longer; if this fails, rmtree takes it
            os.rename(tmp / OLD, tmp / "replaced")
    fsync_dir(out.parent)


def _output_error(e: OSError, out: Path, tmp: Path, build: Path) -> OSError | OutputError:
    """`e` told about `out` when it came from writing inside the temporary directory (never its name)."""
    if e.errno is None:
        return e
    name = e.filename if isinstance(e.filename, str | os.PathLike) else None
    if name is not None:
        p = Path(os.fsdecode(name))
        if p == tmp or tmp in p.parents:
            where = f" (writing {p.relative_to(build)})" if build in p.parents else ""
            return OutputError(f"{out}: {e.strerror or e}{where}")
        return e
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO):
        return OutputError(f"{out}: {e.strerror or e}")
    return e


@contextlib.contextmanager
def atomic_dir(out: Path, *, marker: str | None = None) -> Iterator[Path]:
    """Yield a fresh build directory that replaces `out` when the block succeeds.

    `out`'s parent must exist. On any exception (or SIGINT/SIGTERM) the build directory is
    removed and `out` is left as it was; a SIGKILL or a power cut at any moment leaves the
    old or the new `out` complete (or the old one aside, which the next clean_stale restores).
    `marker` (the command, e.g. "qnpipe convert") writes MARKER into the finished directory,
    which is what lets a later `--force` replace it. An OSError from writing inside the
    build directory (disk full, ...) becomes an OutputError naming `out`, not a temporary name.
    """
    parent = out.parent
    tmp = parent / f".{out.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build = tmp / "model"
    lock_fd = -1
    with signals_raise():
        try:
            tmp.mkdir()
            lock_fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # a later run removes tmp only once this is released
            build.mkdir()
            try:
                yield build
                if marker is not None:
                    (build / MARKER).write_text(json.dumps({"written_by": marker}) + "\n")
                fsync_dir(build)
            except OSError as e:
                err = _output_error(e, out, tmp, build)
                if err is e:
                    raise
                raise err from None
            with signals_blocked():
                try:
                    _put_in_place(build, out, tmp)
                except OSError as e:
                    raise OutputError(f"{out}: cannot put the new output in place ({e.strerror or e})") from None
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
