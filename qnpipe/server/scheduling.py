"""One request at a time on the engine; the others wait in a bounded FIFO queue.

Admission is decided before a response starts (a full queue is a 429 with Retry-After,
never a stalled connection); a request cancelled while it waits (its client left) gives
its place up. trio.Lock is fair, so turns come in arrival order.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class QueueFull(Exception):
    """The queue holds `max_queue` requests already; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy (queue full); retry after {retry_after} s")
        self.retry_after = retry_after


class Scheduler:
    """`ticket = admit()` (raises QueueFull), then `async with turn(ticket):` runs alone."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self._lock = trio.Lock()
        self.waiting = 0  # admitted, not yet running
        self.peak_waiting = 0
        self.running = 0
        self.rejected = 0
        self._mean_s = 1.0  # running mean of a turn's length, for Retry-After

    def admit(self) -> None:
        """Take a place in the queue, or raise QueueFull. Pair with `turn` (or `leave`)."""
        if self.waiting >= self.max_queue and (self._lock.locked() or self.waiting > 0):
            self.rejected += 1
            raise QueueFull(max(1, math.ceil(self._mean_s * (self.waiting + 1))))
        self.waiting += 1
        if self._lock.locked():  # a request that finds the engine free never waits
            self.peak_waiting = max(self.peak_waiting, self.waiting)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for the engine (after `admit`); the place is given up if cancelled while waiting."""
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        t0 = trio.current_time()
        try:
            yield
        finally:
            self.running -= 1
            self._mean_s = 0.8 * self._mean_s + 0.2 * (trio.current_time() - t0)
            self._lock.release()

    def leave(self) -> None:
        """Give up an admitted place without taking the turn."""
        self.waiting -= 1
