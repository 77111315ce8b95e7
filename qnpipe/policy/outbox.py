"""What a sans-IO core answers, and the one shape every core has.

A core (the pool's `PoolCore`, the read scheduler's `ReadCore`, the forward's `ForwardCore`)
takes inputs and the time and answers with commands: `handle(msg, now) -> Outbox` for one
inbox message, `end_turn(now) -> Outbox` when a turn's inbox is done, `statistics()` a
frozen snapshot of its counters. A driver (the trio actors, replay's heap loop) only
delivers what an `Outbox` holds; it never asks a core for a side list afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from qnpipe.messages import Candidates, ForwardInbox, Msg, PoolInbox, ReadInbox
from qnpipe.policy.read_queue import Job

if TYPE_CHECKING:
    from qnpipe.steps import PartGrant


class Batch(msgspec.Struct):
    """Jobs put on the device together at `started` (clock seconds); `number` counts batches from 1."""

    number: int
    jobs: list[Job]
    started: float


class Outbox(msgspec.Struct):
    """What one answer of a core sends, by receiver, and the event-log records it made.

    `batches`: reads to put on the device now (the read scheduler's); `run`: the forward's
    backend computes this part (or, early, queues the work of the experts it names).
    A msgspec Struct: a core makes one per answer, and its lists are made in C, a third
    faster than by a Python `__init__` (attrs' factories take twice as long again).
    """

    forward: list[ForwardInbox] = msgspec.field(default_factory=list)
    reads: list[ReadInbox] = msgspec.field(default_factory=list)
    pool: list[PoolInbox] = msgspec.field(default_factory=list)
    predictor: list[Candidates] = msgspec.field(default_factory=list)
    log: list[Msg] = msgspec.field(default_factory=list)
    batches: list[Batch] = msgspec.field(default_factory=list)
    run: PartGrant | None = None

    def extend(self, other: Outbox) -> Outbox:
        """`other`'s commands after this one's (a turn's answers in order); returns self."""
        self.forward += other.forward
        self.reads += other.reads
        self.pool += other.pool
        self.predictor += other.predictor
        self.log += other.log
        self.batches += other.batches
        if other.run is not None:
            assert self.run is None, "two parts to run in one answer"
            self.run = other.run
        return self


class Core(Protocol):
    """A sans-IO core: inputs and the time in, an `Outbox` of commands out."""

    def handle(self, msg: Any, now: float) -> Outbox: ...

    def end_turn(self, now: float) -> Outbox: ...

    def statistics(self) -> Any: ...


__all__ = ["Batch", "Core", "Outbox"]
