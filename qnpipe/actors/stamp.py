"""Per-sender message stamps: the trio clock's time and a sequence number."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict, TypeVar

import trio

T = TypeVar("T")


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


def drain(inbox: trio.MemoryReceiveChannel[T], first: T) -> Iterator[T]:
    """`first`, then every message already in `inbox`, without yielding to the scheduler.

    An actor that takes its backlog in one turn wakes once per burst instead of once per message.
    """
    yield first
    while True:
        try:
            yield inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return


async def send_soon(tx: trio.MemorySendChannel[T], msg: T, *, shield: bool = False) -> None:
    """Send without a checkpoint when there is room (the usual case on a proven bound), else wait.

    `shield`: a must-deliver message; a cancellation then never drops it halfway, so what the
    sender believes it holds is what the receiver believes it gave.
    """
    try:
        tx.send_nowait(msg)
    except trio.WouldBlock:
        with trio.CancelScope(shield=shield):
            await tx.send(msg)
