"""The MLX thread's trio loop: hosted tasks call MLX inline, work submitted from other
threads and other trio loops runs on it, and a hosted task's failure reaches its caller."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.lowlevel

from qnpipe.live.mlx_thread import MLXThread, run_on


def _name() -> str:
    return threading.current_thread().name


def test_hosted_tasks_run_inline_and_other_threads_work_runs_between_them() -> None:
    th = MLXThread(name="test-mlx")
    assert th.submit(_name).result(timeout=10) == "test-mlx"
    from_other: list[str] = []

    async def task() -> list[str]:
        inline = [await run_on(th, _name) for _ in range(3)]  # no hand-off: the loop is on the thread
        other = threading.Thread(target=lambda: from_other.append(th.submit(_name).result()))
        other.start()
        await trio.to_thread.run_sync(other.join)  # its job runs in this loop meanwhile
        with pytest.raises(RuntimeError, match="MLX thread"):
            th.host(task)  # waiting here for a task of this very loop would never end
        return inline

    a, b = th.host(task), th.host(task)  # two hosted at once, as two sync Engines are
    assert a.result(timeout=10) == b.result(timeout=10) == ["test-mlx"] * 3
    assert from_other == ["test-mlx"] * 2


def test_a_hosted_tasks_error_reaches_its_caller_and_the_loop_lives_on() -> None:
    th = MLXThread(name="test-mlx-err")

    async def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        th.host(boom).result(timeout=10)
    assert th.submit(_name).result(timeout=10) == "test-mlx-err"


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
