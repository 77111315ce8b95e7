"""The one rule for "at the same instant", shared by replay's two drivers.

Within one instant of virtual time, whatever is not an actor's turn runs first (the
forward's step loop, the device's completions: they touch no actor's state), then the
actors take turns one at a time, lowest `(rank, key)` first, each handling its whole
inbox in one turn, sorted by `(t, sender, seq)`; time moves on only when no turn is
wanted. The actor driver gets this order from a replay-only turnstile
(qnpipe.actors.turns); the heap driver (qnpipe.replay.fast) runs it as written. So the
result never depends on the order in which trio wakes tasks, and the two drivers agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from qnpipe.messages import Msg, PrefetchHint, ReadExpired, ReadsDone

M = TypeVar("M", bound=Msg)

# Turn ranks: a finished device batch's bookkeeping (key: the batch's number), the pool, the
# read scheduler's inbox, the predictor.
READS_DONE = 0
POOL = 1
READS = 2
PREDICTOR = 3


def pool_sender(msg: Msg) -> int:
    """Who sent `msg` to the pool: 0 the forward, 1 the read scheduler, 2 the predictor."""
    if isinstance(msg, ReadsDone | ReadExpired):
        return 1
    return 2 if isinstance(msg, PrefetchHint) else 0


def in_turn_order(msgs: Sequence[M]) -> list[M]:
    """A pool turn's inbox in `(t, sender, seq)` order (one sender's messages keep their order)."""
    return sorted(msgs, key=lambda m: (m.t, pool_sender(m), m.seq))


__all__ = ["POOL", "PREDICTOR", "READS", "READS_DONE", "in_turn_order", "pool_sender"]
