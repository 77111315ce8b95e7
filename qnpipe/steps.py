"""What the forward's step loop and its backends say to each other, one MoE layer at a time.

A backend (the MLX model, qnpipe.model.stepper.MlxBackend; or replay's recorded routes,
qnpipe.replay) runs a step to each MoE router and yields a `LayerRoute`; the forward
answers with a `PartGrant` (the slots that hold those experts) and gets the next event,
until `StepDone`. Plain data only: replay uses these without loading MLX's model code.
`LayerRoute` and `PartGrant`, one of each per MoE layer-step, are frozen msgspec Structs:
ten times cheaper to make than a frozen attrs class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import msgspec
import numpy as np


class LayerRoute(msgspec.Struct, frozen=True):
    """MoE layer `layer` needs experts `ids [N, k]` (row = token of the step, router's order).

    `predictions`: for each target layer the predictor looks at from here, the top experts
    of that layer's gate applied to this layer's input, per token: (target, ids [N, W], probs [N, W]).
    `weights [N, k]` (float32) are the router's gate weights of those experts (None when not known).
    """

    layer: int
    ids: np.ndarray
    predictions: tuple[tuple[int, np.ndarray, np.ndarray], ...] = ()
    weights: np.ndarray | None = None


@attrs.frozen
class PredictPlan:
    """What the forward computes for the predictor: target layers per MoE layer, top-`width` each."""

    targets: dict[int, tuple[int, ...]]
    width: int
    use_moe_input: bool = True


class PartGrant(msgspec.Struct, frozen=True):
    """Run tokens `lo:hi` of the layer from slots `slots [hi-lo, k]`; `last` = no part follows.

    `early`: only the experts in memory so far have a slot (the others are -1, being read).
    The backend queues the work of those it has not queued yet and answers `Queued`; more
    early grants may follow as reads land, then the same part's full grant.

    `by_expert`: an expert-major part (qnpipe.policy.parts.plan_parts_by_expert): `lo:hi` is
    every token, and only the pairs of this part's experts have a slot (the others are -1, the
    layer's other parts). The backend runs those pairs; the last part puts all the layer's
    pairs back in the router's order.
    """

    lo: int
    hi: int
    slots: np.ndarray
    last: bool
    early: bool = False
    misses: int = 0  # experts the grant read (the replay's cost charges compute per miss: CostModel.per_miss_s)
    by_expert: bool = False
    pair_tokens: float = 0.0  # by_expert: the part's pairs / top-k, the tokens' worth of its compute

    @property
    def tokens(self) -> float:
        """The tokens' worth of compute the part runs (replay's cost model)."""
        return self.pair_tokens if self.by_expert else self.hi - self.lo


@attrs.frozen
class Queued:
    """The work of an early grant's experts is queued (not necessarily done: its slots stay held)."""


@attrs.frozen
class PartDone:
    """A part that is not the last was computed and evaluated."""


@attrs.frozen
class StepDone:
    """The step's forward ended; `value` is what its tail made of the final hidden states.
    `stopped`: its `first_sync` ended it before its first route (no tail ran; `value` is None)."""

    value: Any
    stopped: bool = False


class Hits(Protocol):
    """What a backend asks at a router before yielding its `LayerRoute` (the forward actor, when the pool
    can answer in its turn): the slots to run the layer from at once, then the layer's turn."""

    def hit_slots(self, route: LayerRoute) -> np.ndarray | None:
        """`route`'s slots `[N, k]` when its grant is certain now, else None (yield the route)."""
        ...

    def hit_queued(self, route: LayerRoute, slots: np.ndarray) -> None:
        """The layer's experts are queued from `slots`: the turn the yield would have had."""
        ...

    def grant_queued(self) -> None:
        """A yielded layer's work (and the next layer's attention and router) is queued: the turn of a grant
        the forward gave before it (its reads' end), if any."""
        ...


Event = LayerRoute | PartDone | Queued | StepDone
Tail = Callable[[Any], Any]  # the step's final hidden states -> its value (an mx.array, in a live run)


