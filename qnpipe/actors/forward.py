"""The forward actor's step loop: drive the model layer by layer, acquiring experts from the pool.

For each MoE layer the backend reports the router's ids (`LayerRoute`); the forward
splits the step's tokens into parts that fit the layer (qnpipe.policy.parts), sends
`Acquire` for each part's experts, waits for `Granted`, maps every token's experts to
their slots and lets the backend run them. It releases a grant as soon as the backend
returns from the part: the backend only returns after an evaluation that depends on
that part's expert outputs, so the slots may then be rewritten (qnpipe.model.slots).

The decisions (pace, candidates, parts, acquires, the lookup table, releases, stall
accounting, the stale-grant rule) are `ForwardCore`'s (qnpipe.policy.forward_core), which
replay's heap driver runs too; this module is its trio shell. The backend is the seam: the MLX model on its thread here, a recorded routing log with
a cost model in replay. Cancellation stops the step at the next layer, releases what
the step held, and leaves the pipeline ready for the next one.

With `inline` (qnpipe.actors.pool.InlinePool, `use_inline`) an acquire the pool can grant
at once is answered in the forward's own turn (live, one with misses too when the read scheduler
is idle: its reads go on the device in that turn, its grant comes by channel), and a layer's last `Release` waits for the
next `Acquire` (or the step's `ForwardDone`) to go with it (the core's `hold_last_release`),
as it would reach the pool's turn anyway: the pool needs nothing earlier. Replay's heap
driver does the same (qnpipe.replay.fast).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import attrs
import numpy as np
import trio

from qnpipe.actors.pool import InlinePool
from qnpipe.actors.read_scheduler import Claimed, settle
from qnpipe.actors.stamp import send_soon
from qnpipe.errors import PipelineError
from qnpipe.messages import Acquire, Candidates, ForwardInbox, Msg, PoolInbox, Release
from qnpipe.policy.forward_core import ForwardCore, ForwardStats
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pace import Pace
from qnpipe.steps import Event, Hits, LayerRoute, PartGrant, Queued, StepDone, Tail


def _foreseen(got: PartGrant | None, want: PartGrant, what: str) -> None:
    """A grant the backend ran before its turn: the pool's, taken at that turn, must be the same part."""
    if (got is None or (got.lo, got.hi, got.last, got.early, got.by_expert)
            != (want.lo, want.hi, want.last, want.early, want.by_expert) or not np.array_equal(got.slots, want.slots)):
        raise AssertionError(f"the pool's grant {got} is not {what} {want}")


class Backend(Protocol):
    """What the forward drives: one step of the model, yielding at each MoE router."""

    async def begin(self, inputs: Any, cache: Any, tail: Tail) -> Event: ...

    async def resume(self, grant: PartGrant) -> Event: ...

    async def abort(self) -> None: ...


class HitsBackend(Backend, Protocol):
    """A backend whose steps run hits before their turn (`takes_hits`: qnpipe.live.loaded.ThreadedBackend)."""

    takes_hits: bool

    async def begin(self, inputs: Any, cache: Any, tail: Tail, hits: Hits | None = None,
                    first_sync: Callable[[], bool] | None = None) -> Event: ...


# False: an early grant's hits are queued at once, before the reads of the same turn may be (the way before;
# tools/bench_stream.py's `--miss-ab` sets it). Read when a Forward is made.
_reads_first = True
# False: the other tasks get their turn as soon as the backend returns a route, before the forward's acquire
# (the way before 2026-12-05's evening). Read when a Forward is made.
_route_turn_first = True
# False: a demand batch put on the device in the forward's turn is waited for by the read scheduler's task, which
# hands the grant over by channel (the way before 2026-12-06; A/B benchmarks). Read at each acquire.
_wait_own_reads = True
# False: a grant whose reads the forward waited for itself is taken (the read scheduler's and the pool's turns over
# the reads' end) before the backend runs it, not in the backend's call once its work is queued (`grant_queued`;
# the way before 2026-12-05's night; A/B benchmarks). Read at each wait.
_landed_grants = True
# False: such a grant is foreseen once its reads are done, not while they are on the device (A/B benchmarks).
_foresee_early = True


@attrs.define(eq=False)
class Forward:
    """The step loop over a `Backend`; `to_pool`/`grants` are None when every expert is resident."""

    backend: Backend
    to_pool: trio.MemorySendChannel[PoolInbox] | None
    grants: trio.MemoryReceiveChannel[ForwardInbox] | None
    capacities: dict[int, int]
    num_experts: int
    # A one-part layer-step of fewer (token, expert) pairs asks for early grants: the backend
    # starts the experts in memory while the rest are read (0 = never).
    early_pairs: int = 0
    by_expert: bool = False  # forward.parts=experts: split layer-steps run in parts of experts
    route_verify: bool = False
    emit: Callable[[Msg], None] | None = None  # the recorder's (qnpipe.actors.recorder); None = no trace
    # read.verify_hit_bytes: (layer, experts, slots) -> raises when a slot's bytes differ from disk
    check_bytes: Callable[[int, tuple[int, ...], tuple[int, ...]], Awaitable[None]] | None = None
    to_predictor: trio.MemorySendChannel[Candidates] | None = None
    moe_order: dict[int, int] = attrs.field(factory=dict)  # MoE layer -> its index (deadline estimates)
    failure: list[BaseException] = attrs.field(factory=list)  # set by the engine when an actor died
    union_prof: bool = False  # diag.union_prof: per-layer union sizes by step length
    busy: bool = False  # a step is running (the watchdog only looks then)
    progress: int = 0  # bumped at every layer and grant: what the watchdog watches
    inline: InlinePool | None = None  # answers hits in this task's turn (`use_inline`); None: all by channel
    core: ForwardCore = attrs.field(init=False)
    _unsent: Outbox | None = None  # an answer of the core whose log was being written
    _answered: list[ForwardInbox] = attrs.field(factory=list)  # the inline turn's answers, not yet taken by `_grant`
    # The demand batches the inline turn put on the device for this task to wait for (`_grant`), oldest first.
    _claimed: list[Claimed] = attrs.field(factory=list)
    # A grant the backend runs before its turn (`_grant`): the batch, its bytes, the foreseen grant, the reads' end.
    _landed: tuple[Claimed, list[int], PartGrant, float] | None = None
    landed_taken: int = 0  # grants taken in the backend's call (`grant_queued`; tests, benchmarks)
    _last_open: bool = False  # a layer-step's last part ran and is not released yet (`_release_last`)
    hits_taken: int = 0  # layer-steps the backend ran before their turn (`hit_slots`; tests, benchmarks)
    reads_first: bool = attrs.field(init=False, factory=lambda: _reads_first)  # see `_grant`
    # The backend gives the other tasks no turn when it returns a route: `_layer` gives it once the acquire is sent.
    route_turn_first: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        defer = getattr(self.backend, "defer_route_yield", None)
        self.route_turn_first = _route_turn_first and defer is not None and defer()
        self.core = ForwardCore(self.capacities, self.num_experts, self.moe_order, early_pairs=self.early_pairs,
                                route_verify=self.route_verify, logging=self.emit is not None, by_expert=self.by_expert,
                                union_prof=self.union_prof, hold_last_release=self.inline is not None)

    def use_inline(self, inline: InlinePool) -> None:
        """Answer hits in this task's turn from now on (before the first step)."""
        self.inline = inline
        self.core.hold_last_release = True

    @property
    def stats(self) -> ForwardStats:
        return self.core.stats

    @property
    def pace(self) -> Pace:
        return self.core.pace

    @property
    def takes_hits(self) -> bool:
        """Whether the backend runs in this task's turn and takes `hits` (and `run`'s `first_sync`)."""
        return self.inline is not None and getattr(self.backend, "takes_hits", False)

    async def run(self, inputs: Any, cache: Any, tail: Tail, first_sync: Callable[[], bool] | None = None) -> Any:
        """Run one step; returns its tail's value. Raises the actor's error if the pipeline died.

        `first_sync` (only when `takes_hits`): called in this turn once the step's first router is synced;
        False ends the step there, before its first acquire: it returns None, and the pool never hears of it."""
        self._raise_failure()
        self.core.begin_step()
        self.busy = True
        try:
            if self.takes_hits:
                ev = await cast(HitsBackend, self.backend).begin(inputs, cache, tail, hits=self, first_sync=first_sync)
            else:
                assert first_sync is None, "first_sync needs a backend in this task's turn (takes_hits)"
                ev = await self.backend.begin(inputs, cache, tail)
            while isinstance(ev, LayerRoute):
                ev = await self._layer(ev)
            assert isinstance(ev, StepDone), ev
            if ev.stopped:
                self.core.drop_step()
            else:
                self._release_last()
                out = self.core.end_step(trio.current_time())
                if self.to_pool is not None:
                    await self._send(out)
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._cleanup()
            self._raise_failure()
            raise PipelineError(f"the expert pipeline stopped ({type(e).__name__})") from None
        except BaseException:
            await self._cleanup()
            raise
        finally:
            self.busy = False
        # With every expert resident a step is one MLX call (shielded: run_on) and no channel is
        # touched, so without this a cancellation (Ctrl-C) would never be seen between steps.
        await trio.lowlevel.checkpoint_if_cancelled()
        return ev.value

    async def abandon(self) -> None:
        """Drop the step the backend may still hold (after a step whose value is not wanted)."""
        with trio.CancelScope(shield=True):
            await self.backend.abort()

    def _emit(self, out: Outbox) -> None:
        """The records and the predictor's candidates of `out` (what goes out before the pool's part)."""
        if self.emit is not None:
            # The recorder may raise (a full disk) before the pool has the part's Acquire: the
            # core then holds a part the pool never granted, and its cancel must not release it.
            self._unsent = out
            for r in out.log:
                self.emit(r)
            self._unsent = None
        if self.to_predictor is not None:
            for c in out.predictor:
                self.to_predictor.send_nowait(c)  # the core took only what fits (_room)

    async def _send(self, out: Outbox) -> None:
        assert self.to_pool is not None
        self._emit(out)
        if self.inline is not None and out.pool:
            # With the read scheduler idle too, the turn is taken whatever the acquire asks (`answer_reads`: a
            # miss's reads go on the device); else only when the pool grants it at once (`answer`).
            answers = self.inline.answer_reads(out.pool, self._claimed if _wait_own_reads else None)
            if answers is None and (granted := self.inline.answer(out.pool)) is not None:
                answers = [granted]
            if answers is not None:  # what the forward waits for beyond these comes by channel
                self._answered += answers
                return
        for m in out.pool:
            await send_soon(self.to_pool, m, shield=True)

    def _room(self) -> int:
        """Candidates the predictor's inbox takes now without blocking (trio's send_nowait rule)."""
        if self.to_predictor is None:
            return 0
        st = self.to_predictor.statistics()
        if not st.open_receive_channels:
            return 1 << 30  # send_nowait raises BrokenResourceError, as the step should
        return int(min(st.max_buffer_size - st.current_buffer_used + st.tasks_waiting_receive, 1 << 30))

    # Hits run before their turn. A backend that takes `hits` (MlxBackend) asks `hit_slots` at each
    # router: when the pool would grant the route at once in this turn, it queues the layer's experts
    # from those slots, and the next layer's attention and router, and only then calls `hit_queued`,
    # which takes the very turn `_layer` would have taken (the route, the Acquire, the pool's inline
    # grant), so the device computes while the host does the pipeline's bookkeeping. Both run inside the backend's call, in this task's turn: no other
    # task runs between the two, so the pool's answer cannot change (docs/pool.md, "Hits before
    # their turn"). The layer is released at the next route or the step's end, as `_layer` does after
    # the backend returns from it.

    def hit_slots(self, route: LayerRoute) -> np.ndarray | None:
        """`route`'s slots `[N, k]` when the pool would grant it at once, in one part, in this turn; None: the
        route takes `_layer`'s way. Reads only."""
        inline = self.inline
        if inline is None or self.check_bytes is not None:
            return None
        ids = route.ids
        flat = ids.reshape(-1).tolist()
        cap = self.core.capacities[route.layer]
        # parts, or a CapacityError: `_layer` says (a step of no more pairs than slots always fits)
        if ids.shape[1] > cap or (len(flat) > cap and len(set(flat)) > cap):
            return None
        slots = inline.hit_slots(route.layer, flat)
        return None if slots is None else np.array(slots, dtype=np.int64).reshape(ids.shape)

    def hit_queued(self, route: LayerRoute, slots: np.ndarray) -> None:
        """The backend queued `route`'s experts from `slots` (`hit_slots`, in this turn): the layer's turn."""
        assert self.inline is not None
        out = self._route(route)
        self._emit(out)
        granted = self.inline.answer(out.pool)
        run = None if granted is None else self.core.handle(granted, granted.t).run
        # hit_slots said this turn grants exactly these slots; the experts already ran from them
        _foreseen(run, PartGrant(0, len(slots), slots, last=True), f"layer {route.layer}: the hit")
        self.progress += 1
        self.hits_taken += 1
        self._last_open = True

    def _release_last(self) -> None:
        """Release the layer-step's last part (with `inline`: its Release is held for the next message), once the
        backend has evaluated what depends on it: after its call returns, or at a hit's turn inside that call."""
        if self._last_open:
            self._last_open = False
            out = self.core.part_done(trio.current_time())
            assert not out.pool and not out.log, out  # the Release is held for the next message (use_inline)

    def _route(self, route: LayerRoute) -> Outbox:
        """A layer-step starts: the previous one's last part is released, then the core's route (its first Acquire)."""
        self._release_last()
        self.progress += 1
        return self.core.route(route.layer, route.ids.reshape(-1).tolist(), route.ids.shape[1], trio.current_time(),
                               ids=route.ids, weights=route.weights,
                               predictions=route.predictions if self.to_predictor is not None else (),
                               room=self._room())

    async def _layer(self, route: LayerRoute) -> Event:
        assert self.to_pool is not None and self.grants is not None
        core = self.core
        out = self._route(route)
        owed = self.route_turn_first
        while True:
            await self._send(out)
            if owed:
                # The turn the backend did not give the other tasks as it returned the route: given now that the
                # route's acquire is answered or sent (and with misses, their reads on the device).
                await trio.lowlevel.cancel_shielded_checkpoint()
            grant, g = await self._grant(yielded=owed)
            owed = False
            self.progress += 1
            if self.check_bytes is not None:
                assert g is not None  # a grant runs before its turn only without check_bytes
                await self.check_bytes(route.layer, g.experts, g.slots)
            if grant.last and self.inline is not None:
                # A hit's turn inside the call (`hit_queued`) releases it first, as it must go before that
                # layer's Acquire; else it is released as the call returns.
                self._last_open = True
                ev = await self.backend.resume(grant)
                if self._landed is not None:  # a backend that did not take the grant's turn in its call
                    await self._land()
                self._release_last()
                return ev
            ev = await self.backend.resume(grant)
            out = core.part_done(trio.current_time())
            if grant.last:
                if out.pool:  # its Release, unless held for the next Acquire / ForwardDone (use_inline)
                    await self._send(out)
                return ev

    def grant_queued(self) -> None:
        """The backend queued the work of a grant it ran before its turn (and the next layer's attention and
        router): the turns over its reads' end, which give that grant, taken now (`_grant`). Nothing when none."""
        if self._landed is None:
            return
        claimed, nbytes, run, t = self._landed
        assert self.inline is not None and self.inline.reads is not None
        taken = self.inline.reads.over_now(claimed, nbytes)
        assert taken, "the pool was idle when the grant was foreseen, in this very turn"
        self._landed = None
        assert self.grants is not None
        self._granted(run, self.core.handle(self.grants.receive_nowait(), t).run)

    async def _land(self) -> None:
        """`grant_queued`'s turns after the backend's call, which did not take them: they may wait."""
        assert self._landed is not None and self.inline is not None and self.inline.reads is not None
        assert self.grants is not None
        claimed, nbytes, run, t = self._landed
        self._landed = None
        if self.grants._state.data:  # pyright: ignore[reportPrivateUsage]  # as in `_grant`
            self.inline.reads.over_later(claimed, nbytes)
        else:
            await self.inline.reads.over(claimed, nbytes)
        while (got := self.core.handle(await self.grants.receive(), t).run) is None:
            pass  # a grant of a cancelled step
        self._granted(run, got)

    def _granted(self, run: PartGrant, got: PartGrant | None) -> None:
        """The pool's grant `got` of a part the backend ran before it (`_grant`), taken by the core at the reads'
        end: it must be the one foreseen."""
        _foreseen(got, run, "the grant foreseen")
        self.landed_taken += 1

    async def _grant(self, yielded: bool = False) -> tuple[PartGrant, ForwardInbox | None]:
        """Wait for the part's grant; early grants' work is queued on the way. `yielded`: the other tasks had
        their turn since the acquire was answered in this task (`_answered`)."""
        assert self.grants is not None
        while True:
            if self._answered:  # answered in this turn, at its Acquire's time
                g: ForwardInbox = self._answered.pop(0)
                now = g.t
            else:
                if self._claimed and not self.grants._state.data:  # pyright: ignore[reportPrivateUsage]
                    # The batch of reads this task's turn put on the device: the turns over its end are taken
                    # here (the read scheduler's, the pool's), so its grant is most often in the channel after
                    # it, with no task between the reads' end and the grant's use.
                    assert self.inline is not None and self.inline.reads is not None
                    reads, claimed = self.inline.reads, self._claimed.pop(0)
                    # The grant these reads would complete, foreseen while they are on the device (`foresee`
                    # reads the core's state, which only this task changes, and changes nothing).
                    lands = _landed_grants and self.takes_hits and self.check_bytes is None
                    ahead = self.core.foresee(claimed.batch.jobs) if lands and _foresee_early else None
                    nbytes = await reads.reads_of(claimed)
                    if nbytes is None:  # failed: the read scheduler ends with the error, no grant comes
                        continue
                    if self.grants._state.data:  # pyright: ignore[reportPrivateUsage]
                        # Answers came while it waited (another batch's): taken first, and the turns go to a task
                        # of the read scheduler's, whose sends to this channel may wait until they are.
                        reads.over_later(claimed, nbytes)
                        continue
                    # The grant these reads complete, foreseen: the backend runs it at once, and the turns that
                    # give it are taken in the backend's call once its work is queued (`grant_queued`). Nothing
                    # else runs in between (the backend's call is this task's), so the pool that is idle now
                    # still is then, and gives this very grant (checked there).
                    if lands and not _foresee_early:
                        ahead = self.core.foresee(claimed.batch.jobs)
                    if ahead is not None and self.inline.idle() and reads.pool_idle():
                        self._landed = (claimed, nbytes, ahead, trio.current_time())
                        return ahead, None
                    await reads.over(claimed, nbytes)
                    await trio.lowlevel.checkpoint_if_cancelled()
                    try:
                        g = self.grants.receive_nowait()
                    except trio.WouldBlock:
                        continue
                else:
                    g = await self.grants.receive()
                now = trio.current_time()
                yielded = False  # the pool's turn came after ours: its reads may wait for the read scheduler's
            run = self.core.handle(g, now).run
            if run is None:  # a grant of a cancelled step
                continue
            if not run.early:
                return run, g
            if self.reads_first and not yielded:
                # An early grant comes with the same turn's reads for the read scheduler, woken with us (when
                # the pool did not put them on the device itself): trio runs a batch of woken tasks in either
                # order, so let it put them on the device before our MLX call (a few hundred µs of host work
                # queueing the hits) rather than after.
                await trio.lowlevel.cancel_shielded_checkpoint()
            ev = await self.backend.resume(run)
            assert isinstance(ev, Queued), ev

    async def _cleanup(self) -> None:
        with trio.CancelScope(shield=True):
            if self._landed is not None:  # the pool hears of the reads; the grant comes to a cancelled step
                claimed, nbytes, _, _ = self._landed
                self._landed = None
                if self.inline is not None and self.inline.reads is not None and self.inline.reads.later:
                    self.inline.reads.over_later(claimed, nbytes)  # its sends to this channel may wait
            claimed, self._claimed = self._claimed, []
            for c in claimed:  # not waited for here after all: the read scheduler's task takes it, or settles it
                reads = self.inline.reads if self.inline is not None else None
                if reads is not None and reads.start is not None:
                    reads.disown(c)
                else:
                    await settle(c)
            await self.backend.abort()
            out = self.core.cancel(trio.current_time())  # with the Release held, if any
            self._answered.clear()  # its Release is the core's (the part is acquired)
            self._last_open = False  # ... and so is a hit's
            unsent, self._unsent = self._unsent, None
            if unsent is not None:  # its Releases are due still; its Acquire never left, so nothing is held
                if any(isinstance(m, Acquire) for m in unsent.pool):
                    out.pool.clear()
                out.pool[:0] = [m for m in unsent.pool if isinstance(m, Release)]
            if out.pool and self.to_pool is not None and not self.failure:  # a dead pipeline takes nothing more
                try:
                    for m in out.pool:
                        await self.to_pool.send(m)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    def _raise_failure(self) -> None:
        if self.failure:
            raise self.failure[0]


__all__ = ["Backend", "Forward", "ForwardStats"]
