"""The pool actor's decisions, sans I/O: one message and the time in, what to send out.

`PoolCore.handle(msg, now)` applies one inbox message to the `PoolPolicy` and answers with
an `Outbox` (qnpipe.policy.outbox) of what follows: `Granted` / `Present` for the forward,
`ReadExperts` / `Promote` for the read scheduler, and, when logging, the event-log records.
`end_turn(now)` closes a turn (one `Present` per early grant per burst of reads that landed
in it). The trio actor (qnpipe.actors.pool) and replay's heap driver (qnpipe.replay.fast)
both run it.

An early `Acquire` gets `Present` for its experts already in memory (after its misses'
reads are asked for), then one for the experts of each turn's reads that land while
others are still on their way; `Granted` (all of them) ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import assert_never

import attrs

from qnpipe.messages import (
    Acquire,
    ForwardDone,
    Granted,
    PoolInbox,
    PrefetchHint,
    Present,
    Promote,
    ReadExpert,
    ReadExperts,
    ReadExpired,
    ReadInbox,
    ReadsDone,
    Release,
)
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pool import NOTHING_READ, Grant, PoolPolicy, PoolStatistics, Promotion
from qnpipe.policy.read_queue import ReadClass
from qnpipe.policy.slot_table import Load
from qnpipe.trace.format import Evicted, RecallSample

GrantKey = tuple[int, int, int]


@attrs.define
class PoolCore:
    """The pool's turn logic over `policy`; `logging`: fill `Outbox.log` with the event-log records."""

    policy: PoolPolicy
    logging: bool = False
    seq: int = 0
    early: set[GrantKey] = attrs.field(factory=set)  # pending grants whose step takes Present
    landed: dict[GrantKey, list[tuple[int, int]]] = attrs.field(factory=dict)  # their reads done in this turn
    # Set for one turn by a driver that puts reads on the device from inside the turn (qnpipe.actors.pool's
    # `InlinePool.answer_reads`): an acquire's reads are handed to it (and taken out of the `Outbox`) as soon as
    # the tables have chosen their slots, before the rest of the acquire's turn (`PoolPolicy.acquire`): the same
    # messages, in the same order. Not while logging: the read scheduler's records would precede the pool's.
    reads_now: Callable[[Outbox], None] | None = None

    def _seq(self) -> int:
        self.seq += 1
        return self.seq

    def statistics(self) -> PoolStatistics:
        return self.policy.statistics()

    def preload(self, loads: Sequence[tuple[int, Load]], now: float) -> Outbox:
        """Ask for the reads of experts placed before anything else (autopin's pins), grouped by layer."""
        out = Outbox()
        by_layer: dict[int, list[Load]] = {}
        for layer, ld in loads:
            by_layer.setdefault(layer, []).append(ld)
        for layer, lds in by_layer.items():
            self._read(layer, lds, now, out)
        return out

    def answers_at_once(self, acq: Acquire) -> bool:
        """Whether `acq` is granted the moment it is handled, asking nothing of any other actor: every
        expert resident in the main region and not loading, no acquire deferred, no early grant open.

        The forward's inline turn (qnpipe.actors.pool.InlinePool) handles only such an acquire; its
        answer is then one `Granted` (no read, no promotion, no `Present`)."""
        return not self._held_back(acq.layer, acq.experts) and self.policy.tables[acq.layer].all_ready(acq.experts)

    def hit_slots(self, layer: int, experts: Sequence[int]) -> list[int] | None:
        """The slot of each of `experts` (repeats allowed) when an `Acquire` of them at `layer` would be
        granted at once (`answers_at_once`), else None. Reads only: the grant itself is still the turn's."""
        if self._held_back(layer, experts):
            return None
        return self.policy.tables[layer].ready_slots(experts)

    def _held_back(self, layer: int, experts: Sequence[int]) -> bool:
        """Whether an acquire of `experts` at `layer` may wait or involve another actor even if they are
        all ready: an early grant open, an acquire deferred, or one of them in the side region."""
        policy = self.policy
        if self.early or self.landed or policy.grants.deferred:
            return True
        side = policy.sides.get(layer)
        # a side-region expert may be promoted: placement decides, with reads maybe
        return side is not None and any(e in side.slot_of for e in experts)

    def handle(self, msg: PoolInbox, now: float) -> Outbox:
        """Apply one message at time `now`. Raises RouteError when route verification fails."""
        out = Outbox()
        self._handle(msg, now, out)
        return out

    def turn(self, msgs: Iterable[PoolInbox], now: float) -> Outbox:
        """A whole turn: `handle` of each of `msgs` in order, then `end_turn`, answered as one `Outbox`
        (what extending their answers in order gives; one answer to make and deliver, not one per message)."""
        out = Outbox()
        for msg in msgs:
            self._handle(msg, now, out)
        self._end_turn(now, out)
        return out

    def _handle(self, msg: PoolInbox, now: float, out: Outbox) -> None:
        policy = self.policy
        if self.logging and not isinstance(msg, ReadsDone):  # the scheduler logs a ReadDone per read
            out.log.append(msg)
        match msg:
            case Acquire():
                key = (msg.step, msg.layer, msg.part)
                sent: list[Sequence[Load]] = []
                if self.reads_now is not None and not self.logging:

                    def reads_now(loads: Sequence[Load]) -> None:  # the same reads, sooner on the device
                        self._read(msg.layer, loads, now, out)
                        self.reads_now(out)  # pyright: ignore[reportOptionalCall]  # set for the turn
                        sent.append(loads)

                    acq = policy.acquire(key, msg.experts, msg.t, reads_now)
                else:
                    acq = policy.acquire(key, msg.experts, msg.t)
                if self.logging:
                    out.log += [RecallSample(t=now, seq=self._seq(), step=msg.step, layer=ly, used=used,
                                             predicted=predicted) for ly, used, predicted in acq.recall]
                if not sent:
                    self._read(msg.layer, acq.loads, now, out, acq.promotions)
                if (ready := acq.ready) is not None:
                    self._grant(ready, now, out)
                elif msg.early:
                    self.early.add(key)
                    if (there := policy.present(key))[0]:
                        self._present(key, *there, now, out)
            case ReadsDone():
                read_done = policy.read_done
                for layer, expert, slot in zip(msg.layers, msg.experts, msg.slots, strict=True):
                    done = read_done(layer, expert, slot)
                    if done is NOTHING_READ:  # most reads: skip taking the empty result apart
                        continue
                    for key, e, s in done.landed:
                        if key in self.early:
                            self.landed.setdefault(key, []).append((e, s))
                    if done.loads or done.promotions:
                        self._read(layer, done.loads, now, out, done.promotions)
                    for g in done.grants:
                        self._grant(g, now, out)
            case Release():
                key = (msg.step, msg.layer, msg.part)
                self.early.discard(key)
                self.landed.pop(key, None)
                policy.release(key, msg.token_experts, msg.token_slots)
            case ForwardDone():
                policy.forward_done()
            case PrefetchHint():
                loads = policy.prefetch(msg.step, msg.source, msg.layer,
                                        list(zip(msg.experts, msg.scores, strict=True)))
                if loads:
                    self._send(ReadExperts(t=now, seq=self._seq(), layer=msg.layer,
                                           experts=tuple(ld.expert for ld in loads),
                                           slots=tuple(ld.slot for ld in loads), cls=ReadClass.PREFETCH,
                                           deadline=msg.deadline,
                                           scores=tuple(msg.scores[msg.experts.index(ld.expert)] for ld in loads)),
                               out)
            case ReadExpired():
                if policy.read_expired(msg.layer, msg.expert, msg.slot):
                    self._send(ReadExperts(t=now, seq=self._seq(), layer=msg.layer, experts=(msg.expert,),
                                           slots=(msg.slot,)), out)
                elif policy.into_main:  # its resident slot is free again: an acquire waiting for room may go on
                    done = policy.retry_deferred(msg.layer)
                    self._read(msg.layer, done.loads, now, out, done.promotions)
                    for g in done.grants:
                        self._grant(g, now, out)
            case _:
                assert_never(msg)

    def end_turn(self, now: float) -> Outbox:
        out = Outbox()
        self._end_turn(now, out)
        return out

    def _end_turn(self, now: float, out: Outbox) -> None:
        if self.landed:
            for key in list(self.landed):  # one Present per grant per burst of reads
                got = self.landed.pop(key)
                self._present(key, tuple(e for e, _ in got), tuple(s for _, s in got), now, out)

    def _present(self, key: GrantKey, experts: tuple[int, ...], slots: tuple[int, ...], now: float,
                 out: Outbox) -> None:
        msg = Present(t=now, seq=self._seq(), step=key[0], layer=key[1], part=key[2], experts=experts, slots=slots)
        if self.logging:
            out.log.append(msg)
        out.forward.append(msg)

    def _grant(self, g: Grant, now: float, out: Outbox) -> None:
        self.early.discard(g.key)
        self.landed.pop(g.key, None)  # landed in the same turn as the last read: the grant gives them with the rest
        msg = Granted(t=now, seq=self._seq(), step=g.key[0], layer=g.key[1], part=g.key[2], experts=g.experts,
                      slots=tuple(g.slots), generations=tuple(g.generations), hits=g.hits, misses=g.misses,
                      waited_s=now - g.asked_t)
        if self.logging:
            out.log.append(msg)
        out.forward.append(msg)

    def _read(self, layer: int, loads: Sequence[Load], now: float, out: Outbox,
              promotions: Sequence[Promotion] = ()) -> None:
        # All of a step's misses go to the scheduler in one message, so they go out as one batch.
        if loads:
            self._send(ReadExperts(t=now, seq=self._seq(), layer=layer, experts=tuple(ld.expert for ld in loads),
                                   slots=tuple(ld.slot for ld in loads)), out,
                       [ld.evicted for ld in loads] if self.logging else ())
        for ly, e, _slot in promotions:  # a step now waits on these prefetches
            self._send(Promote(t=now, seq=self._seq(), layer=ly, expert=e), out)

    def _send(self, req: ReadInbox, out: Outbox, evicted: Sequence[int] = ()) -> None:
        if self.logging:
            if isinstance(req, ReadExperts):  # the log keeps a record per read
                self._log_reads(req, evicted, out)
            else:
                out.log.append(req)
        out.reads.append(req)

    def _log_reads(self, req: ReadExperts, evicted: Sequence[int], out: Outbox) -> None:
        for i, (e, s) in enumerate(zip(req.experts, req.slots, strict=True)):
            # The request's time: the scheduler's read.done gives it back as issued_t.
            r = ReadExpert(t=req.t, seq=self._seq(), layer=req.layer, expert=e, slot=s, cls=req.cls,
                           deadline=req.deadline, score=req.scores[i] if req.scores else 0.0)
            if evicted and evicted[i] >= 0:  # right before the read that refills the slot
                out.log.append(Evicted(t=r.t, seq=r.seq, layer=req.layer, expert=evicted[i], slot=s, for_expert=e))
            out.log.append(r)


__all__ = ["Outbox", "PoolCore"]
