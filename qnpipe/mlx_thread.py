"""The one long-lived thread that runs every MLX call of the process.

MLX streams are thread-local and trio's worker threads are pooled and reused by SSD
reads, so MLX work goes to a dedicated thread, started once and fed through a queue.
The thread is shared by all engines and never exits: with mlx 0.32 on the CPU backend,
a thread that ran `mx.fast.scaled_dot_product_attention` and then ends aborts the
process at exit ("terminate called without an active exception"); a parked daemon
thread does not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import trio

T = TypeVar("T")
_lock = threading.Lock()
_shared: MLXThread | None = None


class MLXThread:
    """A dedicated worker: `submit(fn, *args)` runs `fn` on it and returns a Future."""

    def __init__(self, name: str = "qnpipe-mlx"):
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> MLXThread:
        """The process-wide MLX thread, started on first use."""
        global _shared
        with _lock:
            if _shared is None:
                _shared = cls()
            return _shared

    def _run(self) -> None:
        while True:
            fut, fn, args = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller through the Future
                fut.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fut, fn, args))
        return fut

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread and wait for its result (re-raising its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    @property
    def thread(self) -> threading.Thread:
        return self._thread


async def run_on(thread: MLXThread, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on `thread` and wait in trio without blocking the loop.

    A cancellation waits for `fn` to finish (MLX work cannot be interrupted, and every
    call is one layer or one chunk long), then takes effect at the caller's next checkpoint.
    """
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    fut = thread.submit(fn, *args)
    fut.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.CancelScope(shield=True):
        await done.wait()
    return fut.result()
