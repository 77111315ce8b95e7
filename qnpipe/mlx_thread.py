"""One long-lived thread that runs every MLX call of an engine.

MLX streams are thread-local and trio's worker threads are pooled and reused by SSD
reads, so an engine gets its own thread, started once and fed through a queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()


class MLXThread:
    """A dedicated worker: `submit(fn, *args)` runs `fn` on it and returns a Future."""

    def __init__(self, name: str = "qnpipe-mlx"):
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller through the Future
                fut.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if not self._thread.is_alive():
            raise RuntimeError("the engine's MLX thread has stopped (engine closed?)")
        fut: Future[T] = Future()
        self._q.put((fut, fn, args))
        return fut

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread and wait for its result (re-raising its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """Finish queued work, then stop the thread."""
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join()

    @property
    def thread(self) -> threading.Thread:
        return self._thread
