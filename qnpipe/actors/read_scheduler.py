"""The read scheduler: the one queue over the device.

The trio shell of `ReadCore` (qnpipe.policy.read_core), which owns the `ReadQueue`:
requests are merged when duplicate, ordered by class, and put on the device as the
in-flight budget allows, a batch at a time; each finished batch goes back to the pool as
one `ReadsDone` (the event log gets a `ReadDone` per read). A failed read (`ReadError`)
ends the actor with that error.

Live (no replay turnstile), a turn may be taken where its messages are made, when the actor
it belongs to is idle on an empty inbox (`ReadsInline`, `qnpipe.actors.pool.PoolInline`): the
pool's reads are put on the device in the pool's own turn, and a finished batch's `ReadsDone`
is handled by the pool in the task that saw the batch finish. docs/pool.md, "Turns taken where
they are asked", says why no actor can tell. A demand batch put on the device in the forward's
own turn is waited for by the forward itself (`ReadsInline.take`'s `claim`, `Claimed`): the turns
over its end are then taken in the task that waits for its grant, with no task of this actor's
in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.io.device import ExpertDevice, submit
from qnpipe.messages import Msg, PoolInbox, ReadInbox, ReadsDone
from qnpipe.policy.outbox import Batch, Outbox
from qnpipe.policy.read_core import BatchDone, ReadCore, ReadSchedulerStats
from qnpipe.policy.read_queue import Job, ReadClass, ReadQueue
from qnpipe.policy.turn_order import READS, READS_DONE

# A turn's first batch, when known before the turn (`ReadCore.batch_at_once`: one demand request whose reads all
# start at once), goes on the device before the core's bookkeeping of the turn. False: after it (A/B benchmarks).
_submit_first = True


@attrs.frozen(eq=False)
class Claimed:
    """A demand batch on the device that the task which took the turn waits for itself (`ReadsInline.wait`)."""

    batch: Batch
    reading: Awaitable[list[int]]


@attrs.define(eq=False)
class ReadsInline:
    """The read scheduler's turn, taken by the task that has its requests (the pool actor's) when the read
    scheduler is idle on an empty inbox: its next turn would have handled exactly these, first.

    A taker that passes `claim` (the forward, whose acquire asked for the reads) gets the turn's demand batch
    there, as a `Claimed`, instead of the actor's task that would wait for it: it then waits for it where it
    would wait for its grant (`reads_of`) and takes the turns over the batch's end (the read scheduler's, and the
    pool's when it is idle) in its own task, as that task would have (`over`; `disown` hands it back)."""

    inbox: trio.MemoryReceiveChannel[ReadInbox]  # the read scheduler's (only its state is read)
    turn: Callable[[Sequence[ReadInbox]], None] | None = None  # set once the actor runs (its nursery is open)
    turns: int = 0  # taken here (tests, benchmarks)
    claimed: int = 0  # batches waited for by the task that took the turn (tests, benchmarks)
    # Set while the actor runs: a batch's wait started in the actor's task (`disown`); in the caller's, the reads'
    # end (None: they failed, and the actor has the error), then the turns over it, in the caller's task, without
    # a wait (`over_now`), or in a task of the actor's (`over_later`).
    start: Callable[[Batch, Awaitable[list[int]]], None] | None = None
    read_end: Callable[[Awaitable[list[int]]], Awaitable[list[int] | None]] | None = None
    turns_over: Callable[[Batch, list[int]], Awaitable[None]] | None = None
    turns_now: Callable[[Batch, list[int]], None] | None = None
    later: Callable[[Batch, list[int]], None] | None = None
    pool_idle: Callable[[], bool] = lambda: False  # the pool would take a ReadsDone's turn now (set by the wiring)
    _claim: list[Claimed] | None = None  # the taker's, during its turn
    _state: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._state = self.inbox._state  # pyright: ignore[reportPrivateUsage]

    def idle(self) -> bool:
        """Whether `take` would take a turn now: the actor runs and is parked on an empty inbox."""
        state = self._state
        return self.turn is not None and not state.data and len(state.receive_tasks) == 1

    def take(self, msgs: Sequence[ReadInbox], claim: list[Claimed] | None = None) -> bool:
        """Take the turn over `msgs` now if the read scheduler is idle; False (nothing done) if not.
        `claim`: the turn's first batch, when it holds demand reads only, is appended there, to `wait` for."""
        if not self.idle():
            return False
        assert self.turn is not None
        self._claim = claim
        try:
            self.turn(msgs)
        finally:
            self._claim = None
        self.turns += 1
        return True

    def claims(self, batch: Batch) -> list[Claimed] | None:
        """The taker's list when it claims `batch` (the read scheduler's `deliver` asks), else None."""
        claim = self._claim
        if claim is None or claim or any(j.cls is not ReadClass.DEMAND for j in batch.jobs):
            return None
        return claim

    async def reads_of(self, claimed: Claimed) -> list[int] | None:
        """The bytes read per job once a claimed batch's reads are done, or None when they failed (the read
        scheduler ends with the error, as in its own task). Then the turns over the batch's end: `over`, `over_now`
        or `over_later`. The wait ends with the read scheduler, as its own task's would (None then): cancelled, or,
        for a device that shields its waits (`StoreDevice`: its reads write into slot memory), at the reads' end."""
        if self.read_end is None:  # the read scheduler ended (with an error, or a failure elsewhere)
            await settle(claimed)
            return None
        return await self.read_end(claimed.reading)

    async def over(self, claimed: Claimed, nbytes: list[int]) -> None:
        """The turns over the batch's end (the read scheduler's; the pool's when it is idle, else its `ReadsDone`
        by channel). The pool's answers to the forward may wait for room in its channel: a forward takes them here
        only with its channel empty (it holds what one turn sends, a `Present` and a `Granted`), else `over_later`."""
        assert self.turns_over is not None, "the read scheduler stopped with a claimed batch"
        with trio.CancelScope(shield=True):
            await self.turns_over(claimed.batch, nbytes)

    def over_now(self, claimed: Claimed, nbytes: list[int]) -> bool:
        """`over`, taken without a wait when the pool is idle (its turn then is taken here too); False, nothing
        done, when it is not."""
        assert self.turns_now is not None, "the read scheduler stopped with a claimed batch"
        if not self.pool_idle():
            return False
        self.turns_now(claimed.batch, nbytes)
        return True

    def over_later(self, claimed: Claimed, nbytes: list[int]) -> None:
        """`over`, taken by a task of the read scheduler's (for a forward whose channel holds answers to take
        first: the turn's sends to it may wait until it has)."""
        assert self.later is not None, "the read scheduler stopped with a claimed batch"
        self.later(claimed.batch, nbytes)

    def disown(self, claimed: Claimed) -> None:
        """Hand a claimed batch back to the read scheduler's own task (a taker that will not wait for it)."""
        assert self.start is not None, "the read scheduler stopped with a claimed batch"
        self.start(claimed.batch, claimed.reading)


async def read_scheduler(
    inbox: trio.MemoryReceiveChannel[ReadInbox],
    to_pool: trio.MemorySendChannel[PoolInbox],
    *,
    device: ExpertDevice,
    queue: ReadQueue,
    stats: ReadSchedulerStats,
    emit: Callable[[Msg], None] | None = None,
    turns: Turnstile | None = None,
    inline: ReadsInline | None = None,
    pool_inline: Callable[[ReadsDone], Awaitable[bool]] | None = None,
    pool_inline_now: Callable[[ReadsDone], bool] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve read requests until `inbox` closes and every read in flight has finished.

    `turns`: replay's turnstile (qnpipe.actors.turns), None live. Live, `inline` lets the pool take this
    actor's turns where it makes the requests, and `pool_inline` takes the pool's turn over a `ReadsDone`
    here when the pool is idle (True: taken); `pool_inline_now` likewise, without a wait (`ReadsInline.over_now`)."""
    core = ReadCore(queue, stats, logging=emit is not None)

    async with inbox, to_pool, trio.open_nursery() as nursery:

        def deliver(out: Outbox, first: tuple[list[Job], Awaitable[list[int]]] | None = None) -> ReadsDone | None:
            """Act on `out` without waiting; its `ReadsDone` (a batch's turn has one) is the caller's to send.
            `first`: the jobs of `out`'s first batch and its reads, put on the device before the turn."""
            if emit is not None:
                for r in out.log:
                    emit(r)
            done = None
            for m in out.pool:
                if isinstance(m, ReadsDone):
                    done = m
                    continue
                try:  # an expired prefetch: bounded like ReadsDone, one message per outstanding read
                    to_pool.send_nowait(m)
                except trio.WouldBlock:
                    nursery.start_soon(to_pool.send, m)
            for i, b in enumerate(out.batches):
                if i == 0 and first is not None:
                    if b.jobs != first[0]:
                        raise AssertionError(f"the turn's first batch {b.jobs} is not the one started before it "
                                             f"{first[0]}")
                    reading = first[1]
                else:  # submitted in this turn: the I/O starts now, the task only waits for it
                    reading = submit(device, b.jobs)
                claim = inline.claims(b) if inline is not None else None
                if claim is not None:
                    inline.claimed += 1  # pyright: ignore[reportOptionalMemberAccess]
                    claim.append(Claimed(b, reading))
                else:
                    nursery.start_soon(run, b, reading)
            return done

        async def run(batch: Batch, reading: Awaitable[list[int]]) -> None:
            nbytes = await reading
            if turns is not None:
                await turns.turn(READS_DONE, batch.number)
            await turns_over(batch, nbytes)

        async def turns_over(batch: Batch, nbytes: list[int]) -> None:
            done = deliver(core.turn((BatchDone(batch, nbytes),), trio.current_time()))
            if done is not None and not (pool_inline is not None and await pool_inline(done)):
                await send_soon(to_pool, done)  # the channel's bound is proven (actors.pipeline)

        def turns_now(batch: Batch, nbytes: list[int]) -> None:
            """`turns_over` when the pool is idle (`ReadsInline.over_now` checked): its turn taken at once."""
            done = deliver(core.turn((BatchDone(batch, nbytes),), trio.current_time()))
            if done is not None:
                assert pool_inline_now is not None
                taken = pool_inline_now(done)
                assert taken, "the pool was idle a moment ago, in this very turn"

        waiting: set[trio.CancelScope] = set()  # the claimed waits in other tasks: they end with this actor
        shielded = getattr(device, "shields_reads", False)  # no scope could end its waits (and one costs ~5 µs)
        stopped = False

        async def read_end(reading: Awaitable[list[int]]) -> list[int] | None:
            if shielded:
                got = await ended(reading)
                return None if stopped else got  # as a cancelled wait's, when this actor ended meanwhile
            with trio.CancelScope() as scope:
                waiting.add(scope)
                try:
                    return await ended(reading)
                finally:
                    waiting.discard(scope)
            return None  # this actor ended (an actor failed, or the pipeline closes), as its own wait would

        async def ended(reading: Awaitable[list[int]]) -> list[int] | None:
            try:
                return await reading
            except Exception as e:  # as `run`'s: this actor ends with it (unless it ended already)
                if not stopped:
                    nursery.start_soon(_raise, e)
                return None

        def turn_now(msgs: Sequence[ReadInbox]) -> None:
            now = trio.current_time()
            # Live only: in replay's virtual time the early submit gains nothing, and costs the actors driver ~7 %.
            jobs = core.batch_at_once(msgs) if _submit_first and turns is None else None
            first = None if jobs is None else (jobs, submit(device, jobs))
            try:
                out = core.turn(msgs, now)
            except BaseException:
                if first is not None:  # on the device already: waited for, as the reads of a failed actor are
                    nursery.start_soon(ended, first[1])
                raise
            done = deliver(out, first)
            assert done is None, done  # requests and promotions only: no batch finishes in such a turn

        if inline is not None and turns is None:
            inline.turn = turn_now
            inline.start = partial(nursery.start_soon, run)
            inline.read_end, inline.turns_over, inline.turns_now = read_end, turns_over, turns_now
            inline.later = partial(nursery.start_soon, turns_over)
        task_status.started()
        try:
            async for first in inbox:
                if turns is not None:
                    await turns.turn(READS)
                # Take everything already waiting, so one step's misses are one batch on the device.
                turn_now(list(drain(inbox, first)))
        finally:
            stopped = True
            for scope in waiting:
                scope.cancel()
            if inline is not None:
                inline.turn = inline.start = inline.later = None
                inline.read_end = inline.turns_over = inline.turns_now = None


async def settle(claimed: Claimed) -> None:
    """End a claimed batch whose read scheduler has stopped, as its cancelled task would have: a device whose
    reads write into slot memory waits for them (its wait is shielded), any other is cancelled."""
    with trio.CancelScope() as scope:
        scope.cancel()
        with contextlib.suppress(Exception):
            await claimed.reading


async def _raise(e: BaseException) -> None:
    raise e


__all__ = ["Claimed", "ReadSchedulerStats", "ReadsInline", "read_scheduler", "settle"]
