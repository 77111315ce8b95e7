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


def test_an_inline_call_yields_after_it_unless_its_value_says_the_caller_will(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_on(..., yield_after=...)` in the thread's own loop: the other tasks get their turn (a checkpoint) after
    the call only when `yield_after(value)` is true (the forward takes a route's turn first:
    qnpipe.actors.forward), and always after a call that raised."""
    th = MLXThread(name="test-mlx-yield")
    given = 0
    real = trio.lowlevel.cancel_shielded_checkpoint

    async def counted() -> None:
        nonlocal given
        given += 1
        await real()

    monkeypatch.setattr(trio.lowlevel, "cancel_shielded_checkpoint", counted)

    async def task() -> list[int]:
        seen = []
        for value in (1, 2, 3, 4):
            before = given
            assert await run_on(th, lambda v=value: v, yield_after=lambda v: v % 2 == 0) == value
            seen.append(given - before)
        before = given
        assert await run_on(th, lambda: 5) == 5  # no yield_after: always
        seen.append(given - before)
        before = given
        with pytest.raises(ValueError, match="odd"):
            await run_on(th, lambda: (_ for _ in ()).throw(ValueError("odd")), yield_after=lambda v: False)
        seen.append(given - before)
        return seen

    assert th.host(task).result(timeout=10) == [0, 1, 0, 1, 1, 1]
