"""`deadline(seconds)`: fail a block that takes too long instead of letting a test hang (SIGALRM)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the block after `seconds` (main thread only; a blocking open or read is the usual cause)."""
    def boom(signum: int, frame: object) -> None:
        raise TimeoutError(f"took more than {seconds}s (a blocking open or read?)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
