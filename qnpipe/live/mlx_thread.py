"""The one long-lived thread that runs every MLX call of the process.

MLX streams are thread-local and trio's worker threads are pooled and reused by SSD
reads, so MLX work goes to a dedicated thread, started once and fed through a queue.
The thread is shared by all engines and never exits: with mlx 0.32 on the CPU backend,
a thread that ran `mx.fast.scaled_dot_product_attention` and then ends aborts the
process at exit ("terminate called without an active exception"); a parked daemon
thread does not.

The thread runs a trio loop, which hosts every sync `Engine` (`host`): their actors and
step loops are tasks there and their MLX calls run inline, with no hand-off between
threads per MoE layer (two wake-ups per layer cost ≈ 0.1-0.25 ms on a 2-core VM). MLX
work submitted from other threads (an `open_engine` in the caller's trio loop) runs in
that loop between its tasks. Either way this thread stays the only MLX caller.
"""

from __future__ import annotations

import atexit
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
    """A dedicated worker: `submit(fn, *args)` runs `fn` on it and returns a Future.

    The thread runs a trio loop for its whole life: submitted work is queued and run by a
    `run_sync_soon` callback of that loop, and `host(async_fn)` runs a task in it.
    """

    def __init__(self, name: str = "qnpipe-mlx"):
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._loop,), name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        atexit.register(self._park)

    def _park(self) -> None:
        """At exit, leave the thread blocked without the GIL for good.

        A daemon thread that wakes during finalization is ended by CPython, and an MLX
        thread that ends aborts the process (above); a woken trio loop would do just that.
        """
        parked = threading.Event()
        lock = threading.Lock()
        lock.acquire()

        def park() -> None:
            parked.set()
            lock.acquire()  # never released

        self.submit(park)
        parked.wait(timeout=30)  # after the MLX call in progress, if any

    @classmethod
    def shared(cls) -> MLXThread:
        """The process-wide MLX thread, started on first use."""
        global _shared
        with _lock:
            if _shared is None:
                _shared = cls()
            return _shared

    async def _loop(self) -> None:
        async with trio.open_nursery() as nursery:
            self._token, self._nursery = trio.lowlevel.current_trio_token(), nursery
            self._ready.set()
            await trio.sleep_forever()

    def _drain(self) -> None:
        while True:
            try:
                fut, fn, args = self._q.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller through the Future
                fut.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fut, fn, args))
        assert self._token is not None
        self._token.run_sync_soon(self._drain)
        return fut

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread and wait for its result (re-raising its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def host(self, async_fn: Callable[[], Awaitable[T]]) -> Future[T]:
        """Run `await async_fn()` as a task of this thread's trio loop; its MLX calls run inline.

        RuntimeError from the thread itself (waiting there for the task would never end).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync qnpipe.Engine cannot be opened from the MLX thread (an engine "
                               "callback); in trio code use qnpipe.open_engine")
        fut: Future[T] = Future()

        async def task() -> None:
            try:
                fut.set_result(await async_fn())
            except BaseException as e:  # the caller waits on the Future; the loop lives on
                fut.set_exception(e)

        assert self._token is not None and self._nursery is not None
        self._token.run_sync_soon(self._nursery.start_soon, task)
        return fut

    @property
    def thread(self) -> threading.Thread:
        return self._thread


def _wake(token: trio.lowlevel.TrioToken, done: trio.Event) -> None:
    try:
        token.run_sync_soon(done.set)
    except trio.RunFinishedError:  # the waiting loop was ended (a KeyboardInterrupt): nobody is left to tell
        pass


async def run_on(thread: MLXThread, fn: Callable[..., T], *args: Any,
                 yield_after: Callable[[T], bool] | None = None) -> T:
    """Run `fn(*args)` on `thread` and wait in trio without blocking the loop.

    A cancellation waits for `fn` to finish (MLX work cannot be interrupted, and every
    call is one layer or one chunk long), then takes effect at the caller's next checkpoint.
    In the loop `thread` hosts, `fn` runs inline, then the other tasks get their turn, unless
    `yield_after` says no for its value: the caller then gives them their turn itself, soon.
    """
    if threading.current_thread() is thread.thread:
        try:
            out = fn(*args)
        except BaseException:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        if yield_after is None or yield_after(out):
            await trio.lowlevel.cancel_shielded_checkpoint()
        return out
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    fut = thread.submit(fn, *args)
    fut.add_done_callback(lambda _: _wake(token, done))
    with trio.CancelScope(shield=True):
        await done.wait()
    return fut.result()
