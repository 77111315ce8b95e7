"""The pool actor: answers `Acquire` with slots once the experts are in memory.

The trio shell of `PoolCore` (qnpipe.policy.pool_core), which owns the decisions over the
slot tables (qnpipe.policy.pool.PoolPolicy): each turn takes every message already
waiting, sorted by (t, sender, seq) (qnpipe.policy.turn_order), hands each to the core and
sends what it returns: `Present` / `Granted` to the forward, `ReadExperts` / `Promote` to
the read scheduler (the event log gets a `ReadExpert` per read). The slot memory itself
is the forward's (qnpipe.model.slots); this actor only decides what goes where.

An acquire that is all hits is answered in the forward's own turn (`InlinePool`): the same
core, the same messages and records, no channel hop and no scheduler pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from qnpipe.actors.stamp import drain, send_soon
from qnpipe.actors.turns import Turnstile
from qnpipe.messages import Acquire, ForwardDone, ForwardInbox, Granted, Msg, PoolInbox, ReadInbox
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pool import PoolPolicy
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.slot_table import Load
from qnpipe.policy.turn_order import POOL, in_turn_order


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
    turns: int = 0  # inline turns taken (tests, benchmarks)
    # The channels' shared state, read directly: `statistics()` builds an object per call, twice per
    # layer-step (trio is pinned; qnpipe.actors.turns reads its internals too).
    _inbox_state: Any = attrs.field(init=False)
    _grants_data: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._inbox_state = self.inbox._state  # pyright: ignore[reportPrivateUsage]
        self._grants_data = self.grants._state.data  # pyright: ignore[reportPrivateUsage]

    def hit_slots(self, layer: int, experts: list[int]) -> list[int] | None:
        """The slot of each of `experts` when an `Acquire` of them would be answered here now (`answer`'s
        conditions), else None. Reads only."""
        inbox = self._inbox_state
        if inbox.data or len(inbox.receive_tasks) != 1 or self._grants_data:
            return None
        return self.core.hit_slots(layer, experts)

    def answer(self, msgs: list[PoolInbox]) -> Granted | None:
        """The pool's answer to `msgs` (releases, then one `Acquire`) when it is an immediate grant
        (the turn then is taken at the acquire's time: logged and applied); None, untouched, when the
        actors must take it."""
        acq = msgs[-1]
        if not isinstance(acq, Acquire):
            return None
        inbox = self._inbox_state
        if inbox.data or len(inbox.receive_tasks) != 1 or self._grants_data:
            return None  # the pool has a turn to take (or is taking one): ours would jump the queue
        if not self.core.answers_at_once(acq):
            return None
        try:
            out = self.core.turn(msgs, acq.t)
        except Exception as e:
            self.failure.append(e)
            raise
        assert not out.reads and len(out.forward) == 1 and isinstance(out.forward[0], Granted), out
        self.turns += 1
        if self.emit is not None:
            for r in out.log:
                self.emit(r)
        return out.forward[0]


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
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails.

    `preload`: (layer, load) reads issued before anything else (autopin's pinned experts,
    already placed in `policy`); `after_forward` runs after each ForwardDone (autopin's saves);
    `turns`: replay's turnstile (qnpipe.actors.turns), None live. `core`: the core over `policy`
    when the forward shares it (`InlinePool`); else one is made here.
    """
    if core is None:
        core = PoolCore(policy, logging=emit is not None)
    assert core.policy is policy

    async def deliver(out: Outbox) -> None:
        if emit is not None:
            for r in out.log:
                emit(r)
        for m in out.reads:
            await send_soon(to_reads, m)
        for f in out.forward:
            await send_soon(to_forward, f)

    async with inbox, to_reads, to_forward:
        await deliver(core.preload(preload, trio.current_time()))
        task_status.started()
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
