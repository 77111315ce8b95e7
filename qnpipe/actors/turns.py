"""Replay's turnstile: actor turns one at a time, at quiescence, in the order qnpipe.policy.turn_order sets.

Under a virtual clock every task of a replay is ours, so "everything else is blocked"
(`trio.testing.wait_all_tasks_blocked`) is a well-defined moment: the turnstile grants
the lowest `(rank, key)` wanted turn only then, and the clock moves on (MockClock's
autojump) only when no turn is wanted. The actors' turns therefore happen in the same
order whatever order trio wakes tasks in. The live engine has no turnstile: its actors
run as trio schedules them and never wait on this.
"""

from __future__ import annotations

import math

import trio
import trio.testing
from trio._core._run import GLOBAL_RUN_CONTEXT


class Turnstile:
    """`await turn(rank, key)` blocks until it is that turn; `run` grants turns (one task)."""

    def __init__(self) -> None:
        self._wanted: dict[tuple[int, int], trio.Event] = {}
        self._asked = trio.Event()

    async def turn(self, rank: int, key: int = 0) -> None:
        go = trio.Event()
        if (rank, key) in self._wanted:
            raise AssertionError(f"turn {(rank, key)} asked for twice")
        self._wanted[(rank, key)] = go
        self._asked.set()
        await go.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._wanted:
                self._asked = trio.Event()  # nothing wanted: the clock may jump while this task waits
                await self._asked.wait()
            await trio.testing.wait_all_tasks_blocked()
            if self._wanted:
                self._wanted.pop(min(self._wanted)).set()


def exact_clock() -> trio.testing.MockClock:
    """A MockClock (autojump, threshold 0) whose jumps land on the next deadline exactly.

    MockClock jumps by `next_deadline - now`, and `now + (next_deadline - now)` is not always
    `next_deadline` in floating point: the times a replay sees would then depend on which
    other deadlines (the watchdog's) made the clock stop on the way. Here every stop is a
    deadline's own value, so replay's heap driver, which sets its time to each event's, sees
    the same floats. (Reads trio's deadline heap: a private API, pinned with trio.)
    """
    clock = trio.testing.MockClock(autojump_threshold=0)

    def autojump() -> None:
        d = GLOBAL_RUN_CONTEXT.runner.deadlines.next_deadline()
        if clock.current_time() < d < math.inf:
            clock._virtual_base = d  # rate 0: current_time() is exactly this  # pyright: ignore[reportPrivateUsage]

    clock._autojump = autojump  # pyright: ignore[reportAttributeAccessIssue]
    return clock


__all__ = ["Turnstile", "exact_clock"]
