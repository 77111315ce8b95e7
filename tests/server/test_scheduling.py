"""Scheduler: one at a time, FIFO, bounded; a waiter cancelled gives its place up."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from qnpipe.server.scheduling import QueueFull, Scheduler


async def test_one_at_a_time_in_arrival_order_and_full_queue_refused() -> None:
    sched = Scheduler(max_queue=2)
    order: list[int] = []
    release = trio.Event()

    async def job(i: int) -> None:
        async with sched.turn():
            order.append(i)
            assert sched.running == 1
            await release.wait()

    async with trio.open_nursery() as n:
        for i in range(3):
            sched.admit()
            n.start_soon(job, i)
            await trio.testing.wait_all_tasks_blocked()
        assert sched.waiting == 2 and sched.running == 1
        with pytest.raises(QueueFull) as e:
            sched.admit()
        assert e.value.retry_after >= 1 and sched.rejected == 1
        release.set()
    assert order == [0, 1, 2]
    assert sched.peak_waiting == 2 and sched.waiting == 0 and sched.running == 0


async def test_a_cancelled_waiter_gives_its_place_up() -> None:
    sched = Scheduler(max_queue=1)
    release = trio.Event()

    async def hold() -> None:
        async with sched.turn():
            await release.wait()

    async with trio.open_nursery() as n:
        sched.admit()
        n.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            sched.admit()
            scope.cancel()
            async with sched.turn():
                pytest.fail("a cancelled waiter got the engine")
        assert sched.waiting == 0
        sched.admit()  # the place is free again
        sched.leave()
        release.set()


async def test_max_queue_zero_runs_one_and_refuses_the_rest() -> None:
    sched = Scheduler(max_queue=0)
    sched.admit()
    async with sched.turn():
        with pytest.raises(QueueFull):
            sched.admit()
    sched.admit()
    sched.leave()
