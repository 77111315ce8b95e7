"""The forward actor's step loop: drive the model layer by layer, acquiring experts from the pool.

For each MoE layer the backend reports the router's ids (`LayerRoute`); the forward
splits the step's tokens into parts that fit the layer (qnpipe.policy.parts), sends
`Acquire` for each part's experts, waits for `Granted`, maps every token's experts to
their slots and lets the backend run them. It releases a grant as soon as the backend
returns from the part: the backend only returns after an evaluation that depends on
that part's expert outputs, so the slots may then be rewritten (qnpipe.model.slots).

The backend is the seam: the MLX model on its thread here, a recorded routing log with
a cost model in replay. Cancellation stops the step at the next layer, releases what
the step held, and leaves the pipeline ready for the next one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import numpy as np
import trio

from qnpipe.actors.stamp import Stamper, send_soon
from qnpipe.errors import PipelineError
from qnpipe.messages import Acquire, Candidates, ForwardDone, ForwardInbox, Granted, Msg, PoolInbox, Present, Release
from qnpipe.policy.pace import Pace
from qnpipe.policy.parts import plan_parts
from qnpipe.steps import Event, LayerRoute, PartGrant, Queued, StepDone, Tail
from qnpipe.trace import UnionSize, route_record


class Backend(Protocol):
    """What the forward drives: one step of the model, yielding at each MoE router."""

    async def begin(self, inputs: Any, cache: Any, tail: Tail) -> Event: ...

    async def resume(self, grant: PartGrant) -> Event: ...

    async def abort(self) -> None: ...


@attrs.define
class ForwardStats:
    steps: int = 0
    layer_steps: int = 0
    parts: int = 0
    split_layer_steps: int = 0  # layer-steps that needed more than one part
    early_grants: int = 0  # parts whose experts in memory started before the rest were read
    stall_s: float = 0.0  # waiting for grants that had misses
    stall_by_layer: dict[int, float] = attrs.field(factory=dict)
    candidates_dropped: int = 0  # the predictor's inbox was full
    union_sizes: dict[tuple[int, int], list[int]] = attrs.field(factory=dict)  # (tokens, layer) -> [n, sum, max]
    hits: int = 0
    misses: int = 0


@attrs.define(eq=False)
class Forward:
    """The step loop over a `Backend`; `to_pool`/`grants` are None when every expert is resident."""

    backend: Backend
    to_pool: trio.MemorySendChannel[PoolInbox] | None
    grants: trio.MemoryReceiveChannel[ForwardInbox] | None
    capacities: dict[int, int]
    num_experts: int
    # A one-part layer-step of fewer (token, expert) pairs asks for early grants: the backend
    # starts the experts in memory while the rest are read (0 = never; replay's cost model is per layer).
    early_pairs: int = 0
    route_verify: bool = False
    emit: Callable[[Msg], None] | None = None  # the recorder's (qnpipe.actors.recorder); None = no trace
    # read.verify_hit_bytes: (layer, experts, slots) -> raises when a slot's bytes differ from disk
    check_bytes: Callable[[int, tuple[int, ...], tuple[int, ...]], Awaitable[None]] | None = None
    to_predictor: trio.MemorySendChannel[Candidates] | None = None
    moe_order: dict[int, int] = attrs.field(factory=dict)  # MoE layer -> its index (deadline estimates)
    pace: Pace = attrs.field(init=False)
    failure: list[BaseException] = attrs.field(factory=list)  # set by the engine when an actor died
    stats: ForwardStats = attrs.field(factory=ForwardStats)
    _step: int = 0
    union_prof: bool = False  # diag.union_prof: per-layer union sizes by step length
    busy: bool = False  # a step is running (the watchdog only looks then)
    progress: int = 0  # bumped at every layer and grant: what the watchdog watches
    _open: tuple[int, int, int] | None = None  # acquired, not yet released
    _st: Stamper = attrs.field(factory=Stamper)

    def __attrs_post_init__(self) -> None:
        self.pace = Pace(self.moe_order)

    async def run(self, inputs: Any, cache: Any, tail: Tail) -> Any:
        """Run one step; returns its tail's value. Raises the actor's error if the pipeline died."""
        self._raise_failure()
        self._step += 1
        self.pace.new_step()
        self.busy = True
        try:
            ev = await self.backend.begin(inputs, cache, tail)
            while isinstance(ev, LayerRoute):
                ev = await self._layer(ev)
            assert isinstance(ev, StepDone), ev
            if self.to_pool is not None:
                await send_soon(self.to_pool, ForwardDone(**self._st.stamp(), step=self._step), shield=True)
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._cleanup()
            self._raise_failure()
            raise PipelineError(f"the expert pipeline stopped ({type(e).__name__})") from None
        except BaseException:
            await self._cleanup()
            raise
        finally:
            self.busy = False
        self.stats.steps += 1
        # With every expert resident a step is one MLX call (shielded: run_on) and no channel is
        # touched, so without this a cancellation (Ctrl-C) would never be seen between steps.
        await trio.lowlevel.checkpoint_if_cancelled()
        return ev.value

    async def abandon(self) -> None:
        """Drop the step the backend may still hold (after a step whose value is not wanted)."""
        with trio.CancelScope(shield=True):
            await self.backend.abort()

    def _hint(self, route: LayerRoute) -> None:
        now = trio.current_time()
        self.pace.observe(now)
        if self.to_predictor is None:
            return
        for target, ids, probs in route.predictions:
            deadline = self.pace.deadline(now, route.layer, target)
            c = Candidates(**self._st.stamp(), step=self._step, layer=route.layer, target=target,
                           width=ids.shape[-1], token_experts=tuple(ids.reshape(-1).tolist()),
                           token_scores=tuple(probs.reshape(-1).tolist()), deadline=deadline)
            if self.emit is not None:
                self.emit(c)
            try:  # advisory: a busy predictor loses the hint, the forward never waits
                self.to_predictor.send_nowait(c)
            except trio.WouldBlock:
                self.stats.candidates_dropped += 1

    async def _layer(self, route: LayerRoute) -> Event:
        assert self.to_pool is not None and self.grants is not None
        self.progress += 1
        self._hint(route)
        layer = route.layer
        if self.emit is not None:
            self.emit(route_record(self._st.stamp(), self._step, layer, route.ids, route.weights))
        parts = plan_parts(route.ids, self.capacities[layer], layer=layer)
        if self.union_prof:
            n, union = len(route.ids), len({e for _, _, ex in parts for e in ex})
            acc = self.stats.union_sizes.setdefault((n, layer), [0, 0, 0])
            acc[0] += 1
            acc[1] += union
            acc[2] = max(acc[2], union)
            if self.emit is not None:
                self.emit(UnionSize(**self._st.stamp(), step=self._step, layer=layer, tokens=n, union=union))
        self.stats.layer_steps += 1
        self.stats.parts += len(parts)
        self.stats.split_layer_steps += len(parts) > 1
        lut = np.full(self.num_experts, -1, dtype=np.int64)
        ev: Event | None = None
        early = len(parts) == 1 and route.ids.size < self.early_pairs
        for p, (lo, hi, experts) in enumerate(parts):
            key = (self._step, layer, p)
            t0 = trio.current_time()
            await send_soon(self.to_pool, Acquire(**self._st.stamp(), step=key[0], layer=layer, part=p,
                                                  experts=experts, early=early), shield=True)
            self._open = key
            g = await self._grant(key, route.ids[lo:hi], lut, lo, hi)
            self.progress += 1
            self.stats.hits += g.hits
            self.stats.misses += g.misses
            if g.misses:
                waited = trio.current_time() - t0
                self.stats.stall_s += waited
                self.stats.stall_by_layer[layer] = self.stats.stall_by_layer.get(layer, 0.0) + waited
            if self.check_bytes is not None:
                await self.check_bytes(layer, g.experts, g.slots)
            lut[list(g.experts)] = g.slots
            ids = route.ids[lo:hi]
            slots = lut[ids]
            ev = await self.backend.resume(PartGrant(lo, hi, slots, p == len(parts) - 1, misses=g.misses))
            if self.route_verify:
                rel = Release(**self._st.stamp(), step=key[0], layer=layer, part=p,
                              token_experts=tuple(ids.reshape(-1).tolist()),
                              token_slots=tuple(slots.reshape(-1).tolist()))
            else:
                rel = Release(**self._st.stamp(), step=key[0], layer=layer, part=p)
            await send_soon(self.to_pool, rel, shield=True)
            self._open = None
        assert ev is not None
        return ev

    async def _cleanup(self) -> None:
        with trio.CancelScope(shield=True):
            await self.backend.abort()
            if self._open is not None and self.to_pool is not None:
                step, layer, part = self._open
                self._open = None
                try:
                    await self.to_pool.send(Release(**self._st.stamp(), step=step, layer=layer, part=part))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def _grant(self, key: tuple[int, int, int], ids: np.ndarray, lut: np.ndarray, lo: int, hi: int) -> Granted:
        assert self.grants is not None
        while True:
            g = await self.grants.receive()
            if (g.step, g.layer, g.part) == key:
                if isinstance(g, Granted):
                    return g
                assert isinstance(g, Present)
                self.stats.early_grants += 1
                lut[list(g.experts)] = g.slots  # Present: these start now, the rest are being read
                ev = await self.backend.resume(PartGrant(lo, hi, lut[ids], True, early=True))
                assert isinstance(ev, Queued), ev
                continue
            # A grant completed just as its step was cancelled: the pool has had its Release.
            if g.step >= key[0]:
                raise AssertionError(f"grant {(g.step, g.layer, g.part)} while waiting for {key}")

    def _raise_failure(self) -> None:
        if self.failure:
            raise self.failure[0]
