"""Files that appear whole or not at all: written under a temporary name beside them, then renamed.

A reader never sees a torn file, and a crash, an error or Ctrl-C mid-write leaves the old file
(or none) in place: the temporary one is removed. Directories written whole: qnpipe.io.outdir.

`nofollow=True` is for files in a directory someone else may have prepared (the plan cache inside a
model directory): the file and its directory must not be symlinks (OSError ELOOP naming the path), and
the temporary file is made and renamed relative to the directory opened once, so no link is followed.

The file gets the mode a plain `open(path, "w")` would give it (0o666 less the umask), or
the mode of the file it replaces: mkstemp's 0600 would lock other users out of a shared
directory (a snapshot directory, a heat file). Errors name `path`, never the temporary name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def _proc_umask() -> int | None:
    """The process's umask from /proc (Linux), which reads it without changing it; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_umask() -> int:
    # os.umask can only read by setting, which races with threads creating files: where /proc
    # cannot tell, it is done once, here, at import.
    got = _proc_umask()
    if got is not None:
        return got
    old = os.umask(0o022)
    os.umask(old)
    return old


UMASK = _read_umask()


def current_umask() -> int:
    """The umask now (a notebook or a caller may have set another since import), else UMASK."""
    got = _proc_umask()
    return UMASK if got is None else got


def _named(e: OSError, path: Path) -> OSError:
    """`e` (same class and errno) naming `path` instead of the temporary file."""
    if e.errno is None:
        return e
    return OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))


def _symlink_error(path: Path, what: str) -> OSError:
    return OSError(errno.ELOOP, f"{what} is a symlink: not written through", str(path))


def _open_dir(p: Path, nofollow: bool) -> int:
    """A descriptor of `p`'s directory, which the temporary file is made in and renamed relative to."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
    try:
        return os.open(p.parent, flags)
    except OSError as e:  # a link: ELOOP, or ENOTDIR (Linux checks O_DIRECTORY on the link itself)
        linked = nofollow and e.errno in (errno.ELOOP, errno.ENOTDIR) and p.parent.is_symlink()
        raise (_symlink_error(p, f"its directory {p.parent}") if linked else _named(e, p)) from None


def _mode(p: Path, dfd: int, nofollow: bool) -> int:
    """The mode of the file `p` replaces, else what `open(p, "w")` would give; a link refused with `nofollow`."""
    try:
        st = os.stat(p.name, dir_fd=dfd, follow_symlinks=not nofollow)
    except OSError:
        return 0o666 & ~current_umask()
    if stat.S_ISLNK(st.st_mode):
        raise _symlink_error(p, "it")
    return stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, fsync_dir: bool = False, nofollow: bool = False) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends without an error (flushed, fsynced, renamed).

    `fsync_dir` also syncs the directory, so the rename itself survives a power cut (files that
    must outlive the process that wrote them, such as the heat file). `nofollow`: see the module
    doc. Raises OSError naming `path` (a write to the file that fails, a full disk for one, names it too).
    """
    p = Path(path)
    dfd = _open_dir(p, nofollow)
    try:
        mode = _mode(p, dfd, nofollow)
        tmp = f".{p.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            raise _named(e, p) from None
        try:
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), mode)
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as e:
                # Ours (the temporary file, or a write with no name: ENOSPC from f.write) or the caller's (another file).
                if e.filename is None or os.fsdecode(e.filename) == tmp:
                    raise _named(e, p) from None
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if fsync_dir:
            # Best effort: some filesystems cannot sync a directory; the data itself is synced.
            with contextlib.suppress(OSError):
                os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync_dir: bool = False, nofollow: bool = False) -> None:
    """Replace `path` with `data` atomically (atomic_file). Raises OSError naming `path`."""
    with atomic_file(path, fsync_dir=fsync_dir, nofollow=nofollow) as f:
        f.write(data)
