"""The hang guard: ends the process when a plug-in's call never returns (docs/pool.md, "Plug-in policies").

A plug-in eviction policy runs on the thread of the pipeline's loop. While one of its calls
blocks (`time.sleep`, a loop that never ends) nothing else runs there: not the stall watchdog
task, not the engine's close that SIGINT and SIGTERM start, not the server's /health. No code
can unwind a thread stuck in user code, so the guard, a thread of its own, ends the process:

- a call that has run for `diag.watchdog_s` (when > 0): "no progress for N s", exit status 2,
  as the watchdog's StallError gives;
- SIGINT, SIGTERM or SIGHUP while a call runs: if that call still runs STOP_GRACE_S after the
  signal, exit status 128 + the signal.

The message names the plug-in, its class and method, how long the call ran and the bound.
Standard output and error are flushed first (waiting at most FLUSH_S), then `os._exit`: the
engine is not closed, so an event log being written loses its last records.

`install(command)` starts the guard (the `qnpipe` command does, for each subcommand); it sleeps
until a plug-in is built, so a run of the built-in policies pays nothing. qnpipe's signal
handlers call `signalled(signum)` (`chain` puts it before handlers of others: trio's in `serve`). A program
embedding qnpipe may call them too.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from qnpipe.policy.plugin_check import IN_USE, RUNNING

STOP_GRACE_S = 2.0  # a plug-in call still running this long after a signal: the loop cannot act on it
FLUSH_S = 1.0  # at most this long flushing stdout and stderr before the exit (a reader may be gone)
POLL_S = 0.1  # how often the guard looks at the plug-in calls in progress

# (signal, time.monotonic() it came), appended by signal handlers: no lock, which the interrupted thread may hold.
_signals: collections.deque[tuple[int, float]] = collections.deque(maxlen=16)
_started: list[threading.Thread] = []
_lock = threading.Lock()


def signalled(signum: int) -> None:
    """A signal that stops the command came: the guard ends the process if a plug-in call does not return."""
    _signals.append((signum, time.monotonic()))


def chain(*signums: int) -> None:
    """Tell the guard of `signums` before the handlers installed now run (handlers qnpipe does not own, such
    as trio's `open_signal_receiver`'s). Main thread only, as `signal.signal`; a later `signal.signal` undoes it."""
    for signum in signums:
        prev = signal.getsignal(signum)
        if callable(prev):
            def handler(n: int, frame: Any, prev: Callable[[int, Any], Any] = prev) -> None:
                signalled(n)
                prev(n, frame)

            signal.signal(signum, handler)


def install(command: str) -> None:
    """Start the guard (once per process); `command` names the subcommand in its messages."""
    with _lock:
        if not _started:
            t = threading.Thread(target=_watch, args=(command,), name="qnpipe-hang-guard", daemon=True)
            t.start()
            _started.append(t)


def _watch(command: str) -> None:
    IN_USE.wait()
    first: dict[int, tuple[int, float]] = {}  # thread -> (call number, when the guard first saw it)
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        running = dict(RUNNING)  # one C-level copy: the plug-in threads change it as they go
        first = {tid: (n, first[tid][1] if tid in first and first[tid][0] == n else now)
                 for tid, (_, _, n) in running.items()}
        stuck = None
        for tid, (plugin, method, _) in running.items():
            ran = now - first[tid][1]
            if plugin.stall_s > 0 and ran >= plugin.stall_s:
                _stop(command, f"error: no progress for {ran:.1f} s (diag.watchdog_s={plugin.stall_s:g}): "
                               f"{plugin.describe(method)} has not returned", 2)
            if ran >= STOP_GRACE_S:
                stuck = (plugin.describe(method), ran)
        while _signals and now - _signals[0][1] >= STOP_GRACE_S:
            signum, _ = _signals[0]
            if stuck is not None:
                name = signal.Signals(signum).name
                _stop(command, f"stopped by {name}: {stuck[0]} has run for {stuck[1]:.1f} s and did not return "
                               f"within {STOP_GRACE_S:g} s of {name}", 128 + signum)
            _signals.popleft()  # the loop acted on it: nothing was stuck


def _stop(command: str, what: str, status: int) -> None:
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    # Flushed from a thread of its own: a plug-in stuck in a write would hold the stream's lock for good.
    t = threading.Thread(target=flush, name="qnpipe-hang-guard-flush", daemon=True)
    t.start()
    t.join(FLUSH_S)
    text = (f"\nqnpipe {command}: {what}; the process exits now, without closing the engine (no code can stop a "
            f"thread inside a plug-in's call; docs/pool.md, \"Plug-in policies\")\n")
    with contextlib.suppress(OSError):
        os.write(2, text.encode(errors="replace"))
    os._exit(status)


__all__ = ["FLUSH_S", "POLL_S", "STOP_GRACE_S", "chain", "install", "signalled"]
