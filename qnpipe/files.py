"""Reading a small input file whole: a regular file only, never more than a cap.

Every JSON/TOML/text input qnpipe reads whole (config.json, index.json, a heat file, a device
profile, a cost model, a trace header, a grid file...) goes through `read_capped`, so a FIFO
never blocks a read forever, a directory or a device is a clear error, and a file of 10 GB
given where a 10 KB one belongs is refused before a byte is allocated. The caller chooses
the exception class, so each message stays in its family (CheckpointError, ConfigError, ...).
A leaf: it imports nothing of qnpipe but qnpipe.errors, so every layer (the config included) may use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from qnpipe.errors import InputFileError

KiB = 1 << 10
MiB = 1 << 20

# Caps by kind. Each is far above any real file of that kind (the 80B's config.json is 2 KB,
# its experts/index.json ~3 MB, a heat file of 48 x 512 experts ~400 KB) and far below memory.
CONFIG_CAP = 16 * MiB
INDEX_CAP = 256 * MiB
SMALL_CAP = 64 * MiB


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(path: str | os.PathLike[str], *, cap: int | None = None,
                  error: type[Exception] = InputFileError) -> int:
    """The size of `path` after checking it is a regular file (following links) of at most `cap` bytes."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise error(f"{p}: not found") from None
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        what = _kind(st.st_mode)
        raise error(f"{p}: not a regular file ({what})" if what != "not a regular file" else f"{p}: {what}")
    if cap is not None and st.st_size > cap:
        raise error(f"{p}: too large ({st.st_size} bytes; at most {cap} bytes are read for this kind of file)")
    return st.st_size


def open_regular(path: str | os.PathLike[str], *, error: type[Exception] = InputFileError) -> tuple[int, os.stat_result]:
    """A read-only descriptor of `path` and its stat, checked to be a regular file on the descriptor itself.

    O_NONBLOCK: a FIFO (even one swapped in after a check by name) cannot block the open. The caller closes it."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{p}: not a regular file ({_kind(st.st_mode)})")
    return fd, st


def read_capped(path: str | os.PathLike[str], cap: int, *, error: type[Exception] = InputFileError) -> bytes:
    """The bytes of `path`, a regular file of at most `cap` bytes; `error(message naming the file)` otherwise.

    The file is opened with O_NONBLOCK, so a FIFO swapped in after the check cannot block the
    open, and the read stops at `cap` + 1 bytes whatever the file grew to since the stat.
    """
    p = Path(path)
    check_regular(p, cap=cap, error=error)
    fd, _ = open_regular(p, error=error)
    try:
        chunks: list[bytes] = []
        left = cap + 1
        while left > 0:
            b = os.read(fd, min(left, 4 * MiB))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise error(f"{p}: too large (more than {cap} bytes are not read for this kind of file)")
    return data


def read_text_capped(path: str | os.PathLike[str], cap: int, *, error: type[Exception] = InputFileError) -> str:
    """`read_capped` decoded as UTF-8; a file that is not UTF-8 is `error`, naming the file and the byte offset."""
    data = read_capped(path, cap, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{Path(path)}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
