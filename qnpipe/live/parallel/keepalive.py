"""Rank 0's keep-alive: the other ranks' every wait for it is bounded, between requests too.

A later rank waits for rank 0's next message in MLX's ring recv, which nothing interrupts; only
the deadline (`distributed.step_timeout_s`, qnpipe.live.parallel.deadman) ends it. Rank 0 may
rightly send nothing for hours (a server without requests, a chat waiting for its user), so
when it has sent nothing for a quarter of that timeout it sends a `PING`, passed on to the last
rank. A rank 0 that is stopped (SIGSTOP), or hangs outside MLX, stops sending: the others end
after the step timeout, naming it.
"""

from __future__ import annotations

import time

import trio

from qnpipe.errors import DistributedError
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.parallel.ring import Ring

SHARE = 4  # pings per step timeout: three may be late (a long step of rank 0's own) before one is missed


class KeepAlive:
    """`start` in rank 0's trio loop once its engine is up; `stop` before it stops the ring."""

    def __init__(self, ring: Ring, thread: MLXThread) -> None:
        self.ring = ring
        self.thread = thread
        self.every = ring.step_timeout_s / SHARE
        self._scope = trio.CancelScope()

    def start(self) -> None:
        if self.every > 0:  # a step timeout of 0: the others wait for ever anyway
            # A system task: the engine's context manager yields outside any nursery of its own.
            trio.lowlevel.spawn_system_task(self._run, name="qnpipe-ring-keepalive")

    def stop(self) -> None:
        self._scope.cancel()

    async def _run(self) -> None:
        ring = self.ring
        with self._scope:
            while ring.broken is None:
                left = ring.sent_at + self.every - time.monotonic()
                if left > 0:
                    await trio.sleep(left)
                    continue
                try:
                    # On the MLX thread between whole messages: a step's frames are sent by one call there.
                    await run_on(self.thread, ring.ping)
                except DistributedError:
                    return  # kept by the ring: the next request raises it
