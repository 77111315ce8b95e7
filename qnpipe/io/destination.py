"""A read's destination taken apart: its buffers as byte views, and whether a direct read lands in place."""

from __future__ import annotations

import msgspec

from qnpipe.io.reader import ALIGN, WritableBuffer, aligned_len, buffer_address


class Prepared(msgspec.Struct, frozen=True, gc=False):
    """A read destination analysed once (`prepare`), for every read of `nbytes` bytes into it.

    Pass it as `ReadRequest.buf`: a destination read into again and again (a pool slot) is then
    not taken apart on every read (~20 µs for a record's nine tensors).
    """

    nbytes: int
    dest: tuple[memoryview, ...]  # the buffer(s) as bytes, trimmed to nbytes in total
    direct: tuple[memoryview, ...] | None  # the same to aligned_len(nbytes), when a direct read fits in place


def prepare(buf: WritableBuffer, nbytes: int, where: str = "a read") -> Prepared:
    """`buf` (a buffer or a tuple of them, as `ReadRequest.buf`) as a destination of `nbytes` bytes.

    Raises `ValueError` when it is not writable contiguous memory or holds fewer than `nbytes` bytes."""
    segs = _segments(buf, nbytes, where)
    # Direct I/O reads whole 4096-byte blocks into 4096-aligned memory: in place when every buffer
    # (trimmed to the rounded-up length) is a whole number of aligned blocks.
    length = aligned_len(nbytes)
    direct = None
    if sum(m.nbytes for m in segs) >= length:
        direct = trim(segs, length)
        if not all(m.nbytes % ALIGN == 0 and buffer_address(m) % ALIGN == 0 for m in direct):
            direct = None
    return Prepared(nbytes, trim(segs, nbytes), direct)


def _segments(buf: WritableBuffer, nbytes: int, where: str) -> list[memoryview]:
    """A request's destination buffer(s) as writable byte views; ValueError if unusable."""
    bufs = buf if isinstance(buf, tuple | list) else (buf,)
    out = []
    for b in bufs:
        try:
            m = memoryview(b).cast("B")
        except TypeError as exc:
            raise ValueError(f"request buffer for {where} is not a contiguous buffer: {exc}") from None
        if m.readonly:
            raise ValueError(f"request buffer for {where} is read-only")
        out.append(m)
    room = sum(m.nbytes for m in out)
    if not out or room < nbytes:
        raise ValueError(f"request buffers for {where} hold {room} bytes < nbytes {nbytes}")
    return out


def trim(segs: list[memoryview], n: int) -> tuple[memoryview, ...]:
    """The first `n` bytes of `segs`, as views (empty tails dropped)."""
    out = []
    for m in segs:
        if n <= 0:
            break
        out.append(m[:n] if m.nbytes > n else m)
        n -= out[-1].nbytes
    return tuple(out)


def one_or_tuple(segs: tuple[memoryview, ...]) -> memoryview | tuple[memoryview, ...]:
    return segs[0] if len(segs) == 1 else segs



__all__ = ["Prepared", "one_or_tuple", "prepare", "trim"]
