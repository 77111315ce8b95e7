"""Per-sender message stamps: the trio clock's time and a sequence number."""

from __future__ import annotations

from typing import TypedDict

import trio


class Stamp(TypedDict):
    t: float
    seq: int


class Stamper:
    """`stamp()` -> {"t": now, "seq": n} for the next message of one sender."""

    __slots__ = ("_seq",)

    def __init__(self) -> None:
        self._seq = 0

    def stamp(self) -> Stamp:
        self._seq += 1
        return {"t": trio.current_time(), "seq": self._seq}
