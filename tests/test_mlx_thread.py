"""The MLX thread hosting a trio loop: work submitted from other threads runs on it, before,
during and after the loop, and a second loop is refused."""

from __future__ import annotations

import threading

import trio

from qnpipe.mlx_thread import MLXThread, run_on


def _name() -> str:
    return threading.current_thread().name


def test_hosted_loop_runs_inline_and_serves_other_threads_work() -> None:
    th = MLXThread(name="test-mlx")
    assert th.submit(_name).result() == "test-mlx"
    release = threading.Event()
    from_other: list[str] = []

    async def loop() -> list[str]:
        inline = [await run_on(th, _name) for _ in range(3)]  # no hand-off: the loop is on the thread
        assert th.host(loop) is None  # one hosted loop at a time
        other = threading.Thread(target=lambda: from_other.append(th.submit(_name).result()))
        other.start()
        await trio.to_thread.run_sync(other.join)  # its job runs in this loop meanwhile
        release.set()
        return inline

    fut = th.host(loop)
    assert fut is not None
    assert fut.result(timeout=10) == ["test-mlx"] * 3
    assert release.is_set() and from_other == ["test-mlx"]
    # After the loop ended the thread serves its queue again, and can host another loop.
    assert th.submit(_name).result(timeout=10) == "test-mlx"
    again = th.host(loop)
    assert again is not None and again.result(timeout=10) == ["test-mlx"] * 3


def test_run_on_from_another_loop_waits_without_blocking_it() -> None:
    th = MLXThread(name="test-mlx-2")

    async def main() -> tuple[str, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as n:
            n.start_soon(tick)
            got = await run_on(th, lambda: (threading.Event().wait(0.05), _name())[1])
            n.cancel_scope.cancel()
        return got, ticks

    got, ticks = trio.run(main)
    assert got == "test-mlx-2" and ticks > 10
