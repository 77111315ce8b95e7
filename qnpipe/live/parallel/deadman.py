"""The deadline on waits for another rank: MLX's ring send / recv / connect cannot be interrupted.

A peer that dies closes its sockets and the wait fails at once ("connection to a peer was
lost"); one that hangs, or a host that never starts, would block MLX for ever. A thread
watches the one wait in progress and, past its deadline, writes why and ends the process:
nothing else can free a thread blocked inside MLX. `mx.distributed.init` keeps the GIL while it
connects (measured: a ticking thread stopped for the whole wait), so its deadline is kept by a
small child process instead (`outside`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_CODE = 75  # EX_TEMPFAIL: another rank failed us


class Deadman:
    def __init__(self, exit: Callable[[int], None] = os._exit) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, str] | None = None
        self._exit = exit
        self._thread = threading.Thread(target=self._run, name="qnpipe-ring-deadline", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, timeout_s: float, why: str) -> Iterator[None]:
        """Within the block, end the process with `why` once `timeout_s` pass (0 = no deadline)."""
        if timeout_s <= 0:
            yield
            return
        with self._cond:
            self._armed = (time.monotonic() + timeout_s, why)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, why = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                sys.stderr.write(f"qnpipe: {why}\n")
                sys.stderr.flush()
                self._exit(EXIT_CODE)
                self._armed = None  # an `exit` that returns (tests)


# The killer leaves quietly when the process it watches is gone first (a crash must not leave it behind).
_KILLER = """
import os, signal, sys, time
pid, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    if os.getppid() != pid:
        sys.exit(0)
sys.stderr.write(sys.argv[3] + chr(10))
sys.stderr.flush()
try:
    os.kill(pid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


@contextmanager
def outside(timeout_s: float, why: str) -> Iterator[None]:
    """As `Deadman.waiting` for a call that keeps the GIL: a child process ends this one (SIGKILL)."""
    if timeout_s <= 0:
        yield
        return
    child = subprocess.Popen([sys.executable, "-S", "-c", _KILLER, str(os.getpid()), str(timeout_s), f"qnpipe: {why}"])
    try:
        yield
    finally:
        child.kill()
        child.wait()
