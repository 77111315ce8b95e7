"""How a read is put on the device: its plan (`ReadPlan`), or a target planned once for many reads (`Target`)."""

from __future__ import annotations

import msgspec
import numpy as np

from qnpipe.io.reader import CacheMode
from qnpipe.io.runners import Op


class ReadPlan(msgspec.Struct, gc=False):
    """How one request is read: straight into its buffer(s), or via an aligned bounce buffer."""

    op: Op
    dest: tuple[memoryview, ...]  # the caller's buffer(s) as bytes, trimmed to nbytes in total
    skip: int  # bytes of the read before the request's first byte (bounce only)
    bounce: np.ndarray | None
    mode: CacheMode


class Target(msgspec.Struct, frozen=True, gc=False):
    """A file and a destination planned once (`SsdReader.target`): a read of `nbytes` bytes at any block-aligned
    offset of the file lands in the destination in place, so it needs no plan of its own (`SsdReader.start_at`)."""

    fd: int
    bufs: memoryview | tuple[memoryview, ...]  # what the reader's threads read into
    dest: tuple[memoryview, ...]  # the destination as bytes, trimmed to nbytes
    mode: CacheMode
    nbytes: int
    epoch: int  # the reader's `epoch` when planned: stale once a file has fallen back to the page cache


__all__ = ["ReadPlan", "Target"]
