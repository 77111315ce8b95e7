"""Files that appear whole or not at all: written under a temporary name beside them, then renamed.

A reader never sees a torn file, and a crash, an error or Ctrl-C mid-write leaves the old file
(or none) in place: the temporary one is removed. Directories written whole: qnpipe.outdir.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, fsync_dir: bool = False) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends without an error (flushed, fsynced, renamed).

    `fsync_dir` also syncs the directory, so the rename itself survives a power cut (files that
    must outlive the process that wrote them, such as the heat file). Raises OSError.
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync_dir:
        _fsync_dir(p.parent)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync_dir: bool = False) -> None:
    """Replace `path` with `data` atomically (atomic_file). Raises OSError."""
    with atomic_file(path, fsync_dir=fsync_dir) as f:
        f.write(data)


def _fsync_dir(d: Path) -> None:
    # Best effort: some filesystems cannot open or sync a directory; the data itself is synced.
    try:
        dfd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
