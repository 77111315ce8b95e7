"""The one long-lived thread that runs every MLX call of the process.

MLX streams are thread-local and trio's worker threads are pooled and reused by SSD
reads, so MLX work goes to a dedicated thread, started once and fed through a queue.
The thread is shared by all engines and never exits: with mlx 0.32 on the CPU backend,
a thread that ran `mx.fast.scaled_dot_product_attention` and then ends aborts the
process at exit ("terminate called without an active exception"); a parked daemon
thread does not.

The thread can also host one trio loop (`host`): the sync `Engine`'s. Its MLX calls then
run inline, with no hand-off between threads per MoE layer (two wake-ups per layer cost
≈ 0.1-0.25 ms on a 2-core VM), and MLX work others submit meanwhile runs inside that loop,
between its tasks. Either way this thread stays the only MLX caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
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
        self._lock = threading.Lock()
        self._hosting = False  # a `host` job is queued or running (one at a time)
        self._host: trio.lowlevel.TrioToken | None = None  # the hosted loop, while it runs
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
            self._do(self._q.get())

    @staticmethod
    def _do(item: Any) -> None:
        fut, fn, args = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # handed to the caller through the Future
            fut.set_exception(e)

    def _drain(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            self._do(item)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            self._q.put((fut, fn, args))
            host = self._host
        if host is not None:
            try:
                host.run_sync_soon(self._drain)
            except trio.RunFinishedError:  # the hosted loop just ended: `_run` takes it from the queue
                pass
        return fut

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread and wait for its result (re-raising its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def host(self, async_fn: Callable[[], Awaitable[T]]) -> Future[T] | None:
        """Run `trio.run(async_fn)` on this thread; None when it already hosts a loop.

        Work submitted while the loop runs goes through the queue as always and is run by
        the loop (a `run_sync_soon` callback per submit drains it), or by the thread once
        the loop has ended: nothing is lost in between.
        """
        with self._lock:
            if self._hosting or threading.current_thread() is self._thread:
                return None
            self._hosting = True

        async def main() -> T:
            with self._lock:
                self._host = trio.lowlevel.current_trio_token()
            try:
                self._drain()  # what was queued before the loop's token was known
                return await async_fn()
            finally:
                with self._lock:
                    self._host = None

        def run() -> T:
            try:
                return trio.run(main)
            finally:
                with self._lock:
                    self._hosting = False

        return self.submit(run)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


async def run_on(thread: MLXThread, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on `thread` and wait in trio without blocking the loop.

    A cancellation waits for `fn` to finish (MLX work cannot be interrupted, and every
    call is one layer or one chunk long), then takes effect at the caller's next checkpoint.
    In the loop `thread` hosts, `fn` runs inline, then the other tasks get their turn.
    """
    if threading.current_thread() is thread.thread:
        try:
            return fn(*args)
        finally:
            await trio.lowlevel.cancel_shielded_checkpoint()
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    fut = thread.submit(fn, *args)
    fut.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.CancelScope(shield=True):
        await done.wait()
    return fut.result()
