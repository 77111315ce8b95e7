"""Ctrl-C on the ranks after rank 0.

A terminal sends Ctrl-C to every rank it started (`mlx.launch` runs the local ranks in its own
process group), all at once. Rank 0 answers it: it cancels the generation, then stops the ring,
and every rank leaves at that stop. A later rank that died of the same Ctrl-C would leave rank 0
a lost rank to report instead, and exit non-zero. So a later rank waits for rank 0's stop (a lost
rank still ends it at once: qnpipe.live.parallel.ring), and a second Ctrl-C quits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def deferring_ctrl_c(rank: int | None) -> Iterator[None]:
    """Within: Ctrl-C on rank `rank` > 0 says it waits for rank 0; a second one exits 130 at once.

    Does nothing on rank 0 or None, or off the main thread (where signals cannot be handled)."""
    if not rank or threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if seen:
            print(f"qnpipe: rank {rank}: quitting", file=sys.stderr, flush=True)
            os._exit(128 + signum)  # the MLX thread may be inside a ring recv nothing can interrupt
        seen.append(signum)
        print(f"qnpipe: rank {rank}: Ctrl-C: waiting for rank 0 to stop the ring (Ctrl-C again to quit now)",
              file=sys.stderr, flush=True)

    old = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
