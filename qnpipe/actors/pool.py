"""The pool actor: answers `Acquire` with slots once the experts are in memory.

The trio shell of `PoolCore` (qnpipe.policy.pool_core), which owns the decisions over the
slot tables (qnpipe.policy.pool.PoolPolicy): each turn takes every message already
waiting, sorted by (t, sender, seq) (qnpipe.policy.turn_order), hands each to the core and
sends what it returns: `Present` / `Granted` to the forward, `ReadExperts` / `Promote` to
the read scheduler (the event log gets a `ReadExpert` per read). The slot memory itself
is the forward's (qnpipe.model.slots); this actor only decides what goes where.

An acquire that is all hits is answered in the forward's own turn (`InlinePool`): the same
core, the same messages and records, no channel hop and no scheduler pass. Live, a finished
batch's `ReadsDone` is likewise handled in the task that saw the batch finish when the pool
is idle (`PoolInline`), and the reads a turn asks for are put on the device in this turn when
the read scheduler is idle (qnpipe.actors.read_scheduler.ReadsInline); an acquire with misses is then
taken in the forward's turn too (`InlinePool.answer_reads`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.messages import Acquire, ForwardDone, ForwardInbox, Granted, Msg, PoolInbox, ReadInbox, ReadsDone
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pool import PoolPolicy
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.slot_table import Load
from qnpipe.policy.turn_order import POOL, in_turn_order

if TYPE_CHECKING:
    from qnpipe.actors.read_scheduler import Claimed, ReadsInline

# In an acquire with misses taken in the forward's turn (`InlinePool.answer_reads`), its reads go to the read
# scheduler's turn as soon as the tables have chosen their slots, before the rest of the pool's turn
# (`PoolCore.reads_now`). False: after the whole turn (A/B benchmarks).
_reads_first = True


@attrs.define(eq=False)
class InlinePool:
    """The pool's turn taken by the forward itself, for an acquire the core answers at once.

    Allowed only when the pool actor is idle on an empty inbox and the forward's grant channel
    is empty: the turn then handles exactly the messages the actor's next turn would have
    handled first, in the same `(t, sender, seq)` order, and sends nothing to any other actor
    (`PoolCore.answers_at_once`). docs/pool.md, "Hits in the forward's turn", says why no
    actor can tell the difference.
    """

    core: PoolCore
    inbox: trio.MemoryReceiveChannel[PoolInbox]  # the pool actor's (only its statistics are read)
    grants: trio.MemoryReceiveChannel[ForwardInbox]  # the forward's
    emit: Callable[[Msg], None] | None = None
    # The forward's: a turn that raises (RouteError) stops the pipeline as the pool actor's death would.
    failure: list[BaseException] = attrs.field(factory=list)
    # Live: the read scheduler's turn taken where its requests are made. With it, an acquire with misses is
    # taken here too when the read scheduler is idle as well (`answer_reads`).
    reads: ReadsInline | None = None
    turns: int = 0  # inline turns taken (tests, benchmarks)
    read_turns: int = 0  # ... of them with reads (`answer_reads`)
    # The channels' shared state, read directly: `statistics()` builds an object per call, twice per
    # layer-step (trio is pinned; qnpipe.actors.turns reads its internals too).
    _inbox_state: Any = attrs.field(init=False)
    _grants_data: Any = attrs.field(init=False)
    _claim: list[Claimed] | None = None  # `answer_reads`' caller's, during its turn

    def __attrs_post_init__(self) -> None:
        self._inbox_state = self.inbox._state  # pyright: ignore[reportPrivateUsage]
        self._grants_data = self.grants._state.data  # pyright: ignore[reportPrivateUsage]

    def hit_slots(self, layer: int, experts: list[int]) -> list[int] | None:
        """The slot of each of `experts` when an `Acquire` of them would be answered here now (`answer`'s
        conditions), else None. Reads only."""
        if not self.idle():
            return None
        return self.core.hit_slots(layer, experts)

    def answer(self, msgs: list[PoolInbox]) -> Granted | None:
        """The pool's answer to `msgs` (releases, then one `Acquire`) when it is an immediate grant
        (the turn then is taken at the acquire's time: logged and applied); None, untouched, when the
        actors must take it."""
        acq = msgs[-1]
        if not isinstance(acq, Acquire) or not self.idle() or not self.core.answers_at_once(acq):
            return None
        out = self._turn(msgs, acq)
        assert not out.reads and len(out.forward) == 1 and isinstance(out.forward[0], Granted), out
        return out.forward[0]

    def answer_reads(self, msgs: list[PoolInbox], claim: list[Claimed] | None = None) -> list[ForwardInbox] | None:
        """The pool's turn over `msgs` (releases, then one `Acquire`) taken here when the pool and the read
        scheduler are both idle: its reads go on the device through the read scheduler's turn, taken here as the
        pool actor's `deliver` would (`ReadsInline`), and its answers to the forward (a `Granted` when it is granted
        at once, as `answer`'s; an early grant's `Present`; or none) are returned, in order. None, untouched, when
        the actors must take it. `claim`: the caller waits for the turn's demand batch itself (`ReadsInline.take`)."""
        reads = self.reads
        acq = msgs[-1]
        if reads is None or not isinstance(acq, Acquire) or not reads.idle() or not self.idle():
            return None
        if _reads_first:
            self.core.reads_now = self._reads_now
        self._claim, turns = claim, reads.turns
        try:
            out = self._turn(msgs, acq)
            if out.reads:
                self._reads_now(out)
        finally:
            self.core.reads_now = None
            self._claim = None
        self.read_turns += reads.turns > turns  # the read scheduler's turn was taken here
        return out.forward

    def _reads_now(self, out: Outbox) -> None:
        """The read scheduler's turn over `out.reads`, taken now (they leave `out`); the caller's `claim` with it."""
        assert self.reads is not None
        taken = self.reads.take(out.reads, self._claim)
        assert taken, "the read scheduler was idle a moment ago, in this very turn"
        out.reads.clear()

    def idle(self) -> bool:
        """The pool actor parked on an empty inbox and the forward's grant channel empty: a turn taken here
        would be the actor's next, and jump no queue."""
        inbox = self._inbox_state
        return not inbox.data and len(inbox.receive_tasks) == 1 and not self._grants_data

    def _turn(self, msgs: list[PoolInbox], acq: Acquire) -> Outbox:
        """The core's turn over `msgs` at the acquire's time, its records logged."""
        try:
            out = self.core.turn(msgs, acq.t)
        except Exception as e:
            self.failure.append(e)
            raise
        self.turns += 1
        if self.emit is not None:
            for r in out.log:
                self.emit(r)
        return out


@attrs.define(eq=False)
class PoolInline:
    """The pool's turn over a finished batch's `ReadsDone`, taken in the task that saw the batch finish (the
    read scheduler's) when the pool actor is idle on an empty inbox: its next turn would have handled exactly
    this message, first. The answers are delivered as the actor's are (its `deliver`)."""

    inbox: trio.MemoryReceiveChannel[PoolInbox]  # the pool actor's (only its state is read)
    turn: Callable[[ReadsDone], Awaitable[None]] | None = None  # set while the actor runs
    turn_now: Callable[[ReadsDone], None] | None = None  # ... its answers sent without a wait
    turns: int = 0  # taken here (tests, benchmarks)
    _state: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._state = self.inbox._state  # pyright: ignore[reportPrivateUsage]

    def idle(self) -> bool:
        """Whether `take` would take the turn now: the actor runs and is parked on an empty inbox."""
        state = self._state
        return self.turn is not None and not state.data and len(state.receive_tasks) == 1

    async def take(self, done: ReadsDone) -> bool:
        """Take the pool's turn over `done` now if the pool is idle; False (nothing done) if not."""
        if not self.idle():
            return False
        self.turns += 1
        assert self.turn is not None
        await self.turn(done)  # the core's turn is taken before any wait; only a full channel would wait
        return True

    def take_now(self, done: ReadsDone) -> bool:
        """`take` whose answers go out without a wait (the channels' bounds are proven, qnpipe.policy.turn_order:
        a full one is an error here). For a caller that cannot wait (`Forward.grant_queued`)."""
        if not self.idle():
            return False
        self.turns += 1
        assert self.turn_now is not None
        self.turn_now(done)
        return True


async def pool(
    inbox: trio.MemoryReceiveChannel[PoolInbox],
    to_reads: trio.MemorySendChannel[ReadInbox],
    to_forward: trio.MemorySendChannel[ForwardInbox],
    *,
    policy: PoolPolicy,
    preload: Sequence[tuple[int, Load]] = (),
    after_forward: Callable[[], None] | None = None,
    emit: Callable[[Msg], None] | None = None,
    turns: Turnstile | None = None,
    core: PoolCore | None = None,
    inline: PoolInline | None = None,
    reads_inline: ReadsInline | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails.

    `preload`: (layer, load) reads issued before anything else (autopin's pinned experts,
    already placed in `policy`); `after_forward` runs after each ForwardDone (autopin's saves);
    `turns`: replay's turnstile (qnpipe.actors.turns), None live. `core`: the core over `policy`
    when the forward shares it (`InlinePool`); else one is made here. Live, `inline` lets the read
    scheduler take this actor's turn over a `ReadsDone`, and `reads_inline` the read scheduler's turn here.
    """
    if core is None:
        core = PoolCore(policy, logging=emit is not None)
    assert core.policy is policy

    live = turns is None
    if not live:
        reads_inline = None

    async def deliver(out: Outbox) -> None:
        if emit is not None:
            for r in out.log:
                emit(r)
        if out.reads and not (reads_inline is not None and reads_inline.take(out.reads)):
            for m in out.reads:
                await send_soon(to_reads, m)
        for f in out.forward:
            await send_soon(to_forward, f)

    async def turn_done(done: ReadsDone) -> None:
        await deliver(core.turn((done,), trio.current_time()))

    def turn_done_now(done: ReadsDone) -> None:
        out = core.turn((done,), trio.current_time())
        if emit is not None:
            for r in out.log:
                emit(r)
        if out.reads and not (reads_inline is not None and reads_inline.take(out.reads)):
            for m in out.reads:
                to_reads.send_nowait(m)
        for f in out.forward:
            to_forward.send_nowait(f)

    async with inbox, to_reads, to_forward:
        await deliver(core.preload(preload, trio.current_time()))
        if inline is not None and live:
            inline.turn, inline.turn_now = turn_done, turn_done_now
        task_status.started()
        try:
            await _serve(inbox, core, deliver, after_forward, turns)
        finally:
            if inline is not None:
                inline.turn = inline.turn_now = None


async def _serve(inbox: trio.MemoryReceiveChannel[PoolInbox], core: PoolCore,
                 deliver: Callable[[Outbox], Awaitable[None]], after_forward: Callable[[], None] | None,
                 turns: Turnstile | None) -> None:
    async for first in inbox:
        if turns is not None:
            await turns.turn(POOL)
        # Whatever else is already waiting is handled in the same turn: one wake-up, not one per message.
        now = trio.current_time()
        msgs = in_turn_order(list(drain(inbox, first)))
        if after_forward is None:  # the turn's answers in one (sent in the same order)
            await deliver(core.turn(msgs, now))
            continue
        for msg in msgs:
            out = core.handle(msg, now)
            if isinstance(msg, ForwardDone):
                after_forward()
            await deliver(out)
        await deliver(core.end_turn(now))
