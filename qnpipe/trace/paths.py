"""Where an event log goes: checked before the run starts, written beside it until it closes."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from qnpipe.errors import OutputError


def check_output_path(path: str | Path, what: str = "event log", *, probe: bool = True) -> None:
    """Raise OutputError (naming `path`) unless a log can be written there and renamed over `path`.

    `path` must not be a directory or another non-regular file (the rename would replace a
    device or a FIFO), its directory must exist, and with `probe` a file must be creatable in
    that directory (permissions, a read-only or pseudo filesystem such as /proc). Run before
    the work starts, so a bad `--trace` fails in a second, not when the run closes its log.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{p}: cannot write the {what} ({e.strerror or e})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{p}: is a directory; give a file name for the {what}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{p}: not a regular file; the {what} is written beside it and renamed over it")
    parent = p.absolute().parent
    if not parent.is_dir():
        what_is = "is not a directory" if parent.exists() else "does not exist"
        raise OutputError(f"{p}: cannot write the {what}: {parent} {what_is}")
    if not probe:
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise OutputError(f"{p}: cannot write the {what} in {parent} ({e.strerror or e})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def partial_path(path: str | Path) -> Path:
    """Where a TraceWriter of `path` writes until it closes: `<path>.partial`."""
    p = Path(path)
    return p.with_name(p.name + ".partial")


def check_log_paths(cfg: Any) -> None:
    """`check_output_path` of the logs a Config asks for (`trace.event_log_path`, the routing log)."""
    if cfg.trace.event_log_path:
        check_output_path(cfg.trace.event_log_path, "event log")
    if cfg.trace.route_trace:
        check_output_path(cfg.trace.route_trace_path, "routing log")


__all__ = ["check_log_paths", "check_output_path", "partial_path"]
