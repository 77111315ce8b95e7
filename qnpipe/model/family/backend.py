"""`GreenletBackend`: an mlx-lm model's own forward, one MoE layer at a time, for the forward actor.

The same protocol as qnpipe.model.stepper.MlxBackend (`begin`/`resume`/`abort`, `early_pairs`,
`ring_tail`). mlx-lm's `Model.__call__` is plain code: a `PooledSwitch` deep inside it cannot
`yield`, and it cannot block for its grant either, since the pool and read actors run as trio
tasks on this same MLX thread (qnpipe/live/mlx_thread.py): waiting would deadlock. So the forward
runs in a greenlet; each pooled switch switches up to the caller of `begin`/`resume` with its
`LayerRoute` (or `Queued`/`PartDone` between parts), and is switched back into with the grant.

Release rule (qnpipe/model/stepper.py): when `resume` returns, no queued work still reads the
slots granted before it, except after `Queued`. It holds here because `resume` returns only
(1) at the next pooled switch's `np.array(indices)`, whose ids depend on this layer's expert outputs
through the residual stream, so MLX has run them; (2) at `PartDone`, after the part's `mx.eval`;
(3) at `Queued`, where the switch keeps the grant and a dropped step evaluates the queued work
(PooledSwitch's abort path); or (4) with `StepDone`, after the tail, which evaluates the logits
that depend on the last MoE layer. A switch that runs a hit before its turn (the step's `hits`,
docs/pool.md) does not switch up at all: the forward releases that layer at its next route, after
the next switch's sync, or at the step's end, as it would on return from `resume`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import greenlet
import mlx.nn as nn
import numpy as np

from qnpipe.model.stepper import EARLY_PAIRS, MtpRun
from qnpipe.steps import Event, Hits, LayerRoute, PartGrant, StepDone, Tail


class Stopped(Exception):
    """A step's `first_sync` ended it at its first pooled switch (qnpipe.model.stepper.forward_steps)."""


_STOPPED = object()


class Step(greenlet.greenlet):
    """A step's greenlet, with what the forward hands its pooled switches (`GreenletBackend.begin`)."""

    hits: Hits | None = None
    first_sync: Callable[[], bool] | None = None
    held: tuple[LayerRoute, np.ndarray] | None = None  # a hit whose experts are queued, its turn not taken yet

    def take_held(self) -> None:
        """The held hit's turn (`Hits.hit_queued`), if any."""
        if self.held is not None:
            held, self.held = self.held, None
            assert self.hits is not None
            self.hits.hit_queued(*held)


def _run(model: nn.Module, x: Any, cache: list[Any]) -> Any:
    try:
        out = model(x, cache=cache)
    except Stopped:
        return _STOPPED
    step = greenlet.getcurrent()
    if isinstance(step, Step):
        step.take_held()  # the last pooled switch's hit
    return out


class GreenletBackend:
    """One step at a time of mlx-lm's forward of `model` (its switches pooled), driven from trio.
    MLX thread only. Its tails take logits: mlx-lm's `__call__` returns them.

    The step's greenlet carries the forward's `hits` and `first_sync` (as `MlxBackend.begin` takes
    them): the pooled switches read them there (qnpipe.model.family.pooled)."""

    early_pairs = EARLY_PAIRS
    takes_hits = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._g: greenlet.greenlet | None = None
        self._tail: Tail | None = None
        # Pipeline parallel is the native path's alone: never set here.
        self.ring_tail: Callable[[Tail, list[Any]], Tail] | None = None

    def begin(self, inputs: Callable[[], Any], cache: list[Any], tail: Tail, hits: Hits | None = None,
              first_sync: Callable[[], bool] | None = None) -> Event:
        """Start a step on `inputs() [B, L]` and run it to its first pooled switch (or its end).
        `hits`, `first_sync`: as `MlxBackend.begin`'s."""
        self.abort()
        x = inputs()
        if isinstance(x, MtpRun):
            raise ValueError("an MTP step runs on the native Qwen3-Next path only; this model runs "
                             "through mlx-lm's own forward (the family seam), which has no MTP head")
        if self.ring_tail is not None:
            raise ValueError("pipeline parallel runs on the native Qwen3-Next path only")
        model = self.model
        g = self._g = Step(lambda: _run(model, x, cache))
        g.hits, g.first_sync = hits, first_sync  # read by the pooled switches
        self._tail = tail
        return self._advance(None)

    def resume(self, grant: PartGrant) -> Event:
        """Continue the step with the slots of the part it asked for."""
        return self._advance(grant)

    def _advance(self, grant: PartGrant | None) -> Event:
        g, tail = self._g, self._tail
        assert g is not None and tail is not None, "no step in progress"
        # Whoever drives the step now gets the switch's next event (the parent is the switch target).
        g.parent = greenlet.getcurrent()
        try:
            ev = g.switch() if grant is None else g.switch(grant)
        except BaseException:
            self._g = None  # the forward raised: the greenlet is dead
            raise
        if not g.dead:
            return ev
        self._g = None
        if ev is _STOPPED:
            return StepDone(None, stopped=True)
        return StepDone(tail(ev))

    def abort(self) -> None:
        """Drop a step in progress (its cache updates so far stay: start a fresh cache after this).
        GreenletExit unwinds mlx-lm's frames; the pooled switch it lands in first evaluates any
        work it queued on early grants, so their slots may be released after this returns."""
        g, self._g = self._g, None
        if g is not None and not g.dead:
            g.parent = greenlet.getcurrent()
            g.throw(greenlet.GreenletExit)
