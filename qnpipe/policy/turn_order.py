"""The one rule for "at the same instant", and the channels' bounds, shared by replay's two drivers.

Within one instant of virtual time, whatever is not an actor's turn runs first (the
forward's step loop, the device's completions: they touch no actor's state), then the
actors take turns one at a time, lowest `(rank, key)` first, each handling its whole
inbox in one turn, sorted by `(t, sender, seq)`; time moves on only when no turn is
wanted. The actor driver gets this order from a replay-only turnstile
(qnpipe.actors.turns); the heap driver (qnpipe.replay.fast) runs it as written. So the
result never depends on the order in which trio wakes tasks, and the two drivers agree.

The channels' bounds are here too: the actor driver opens its channels with them
(qnpipe.actors.pipeline) and the heap driver drops an advisory message where a full
channel would.
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
RANKS = (READS_DONE, POOL, READS, PREDICTOR)

# Channel bounds. Every outstanding read holds a distinct (layer, slot), so no edge carries more
# than `total` slots' messages (+ the forward's Acquire/Release/ForwardDone): proven, not hoped.
GRANTS_SIZE = 2  # to the forward: a Present, then its Granted


def pool_inbox_size(capacities: dict[int, int]) -> int:
    return sum(capacities.values()) + 4


def reads_inbox_size(capacities: dict[int, int]) -> int:
    return 2 * sum(capacities.values())  # a read and at most one promotion each


def candidates_size(capacities: dict[int, int]) -> int:
    """The predictor's inbox (advisory: one `Candidates` per (layer, target) of a step; a full inbox drops)."""
    return 4 * len(capacities) + 8


def holds(size: int) -> int:
    """Messages a channel of buffer `size` takes before a send would block: its receiver, woken, holds one more."""
    return size + 1


def pool_sender(msg: Msg) -> int:
    """Who sent `msg` to the pool: 0 the forward, 1 the read scheduler, 2 the predictor."""
    if isinstance(msg, ReadsDone | ReadExpired):
        return 1
    return 2 if isinstance(msg, PrefetchHint) else 0


def in_turn_order(msgs: Sequence[M]) -> list[M]:
    """A pool turn's inbox in `(t, sender, seq)` order (one sender's messages keep their order)."""
    return sorted(msgs, key=lambda m: (m.t, pool_sender(m), m.seq))


__all__ = ["GRANTS_SIZE", "POOL", "PREDICTOR", "RANKS", "READS", "READS_DONE", "candidates_size", "holds",
           "in_turn_order", "pool_inbox_size", "pool_sender", "reads_inbox_size"]
