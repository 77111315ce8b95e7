"""The pool actor: answers `Acquire` with slots once the experts are in memory.

An early `Acquire` gets `Present` for its experts already in memory (after the misses' reads
are sent), then one for the experts of each burst of reads that lands while others are
still on their way: the forward starts their work while the rest is read. `Granted` (all
of them) ends it.

Owns the slot tables (qnpipe.policy.pool.PoolPolicy). An acquire's misses become one
`ReadExperts` command to the read scheduler (the event log gets a `ReadExpert` per read);
its `ReadsDone` complete grants. The slot memory itself is the forward's
(qnpipe.model.slots); this actor only decides what goes where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from qnpipe.actors.stamp import Stamper, drain, send_soon
from qnpipe.messages import (
    Acquire,
    ForwardDone,
    ForwardInbox,
    Granted,
    Msg,
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
from qnpipe.policy.pool import Grant, PoolPolicy
from qnpipe.policy.read_queue import ReadClass
from qnpipe.policy.slot_table import Load
from qnpipe.trace import Evicted, RecallSample


async def pool(
    inbox: trio.MemoryReceiveChannel[PoolInbox],
    to_reads: trio.MemorySendChannel[ReadInbox],
    to_forward: trio.MemorySendChannel[ForwardInbox],
    *,
    policy: PoolPolicy,
    preload: Sequence[tuple[int, Load]] = (),
    after_forward: Callable[[], None] | None = None,
    emit: Callable[[Msg], None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the pool until `inbox` closes. Raises RouteError when route verification fails.

    `preload`: (layer, load) reads issued before anything else (autopin's pinned experts,
    already placed in `policy`); `after_forward` runs after each ForwardDone (autopin's saves).
    """
    st = Stamper()
    early: set[tuple[int, int, int]] = set()  # pending grants whose step takes Present
    landed: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # their reads done in this turn

    async def present(key: tuple[int, int, int], experts: tuple[int, ...], slots: tuple[int, ...]) -> None:
        step, layer, part = key
        msg = Present(**st.stamp(), step=step, layer=layer, part=part, experts=experts, slots=slots)
        if emit is not None:
            emit(msg)
        await send_soon(to_forward, msg)

    async def flush(key: tuple[int, int, int]) -> None:
        if got := landed.pop(key, None):
            await present(key, tuple(e for e, _ in got), tuple(s for _, s in got))

    async def grant(g: Grant) -> None:
        step, layer, part = g.key
        early.discard(g.key)
        landed.pop(g.key, None)  # landed in the same turn as the last read: the grant gives them with the rest
        now = trio.current_time()
        msg = Granted(**st.stamp(), step=step, layer=layer, part=part, experts=g.experts, slots=tuple(g.slots),
                      generations=tuple(g.generations), hits=g.hits, misses=g.misses, waited_s=now - g.asked_t)
        if emit is not None:
            emit(msg)
        await send_soon(to_forward, msg)

    def log_reads(req: ReadExperts, evicted: Sequence[int] = ()) -> None:
        assert emit is not None
        for i, (e, s) in enumerate(zip(req.experts, req.slots, strict=True)):
            # The request's time: the scheduler's read.done gives it back as issued_t.
            r = ReadExpert(t=req.t, seq=st.stamp()["seq"], layer=req.layer, expert=e, slot=s, cls=req.cls,
                           deadline=req.deadline, score=req.scores[i] if req.scores else 0.0)
            if evicted and evicted[i] >= 0:  # right before the read that refills the slot
                emit(Evicted(t=r.t, seq=r.seq, layer=req.layer, expert=evicted[i], slot=s, for_expert=e))
            emit(r)

    async def send(req: ReadInbox, evicted: Sequence[int] = ()) -> None:
        if emit is not None:
            if isinstance(req, ReadExperts):  # the log keeps a record per read
                log_reads(req, evicted)
            else:
                emit(req)
        await send_soon(to_reads, req)

    async def read(layer: int, loads: list[Load]) -> None:
        # All of a step's misses go to the scheduler in one message, so they go out as one batch.
        if loads:
            await send(ReadExperts(**st.stamp(), layer=layer, experts=tuple(ld.expert for ld in loads),
                                   slots=tuple(ld.slot for ld in loads)), [ld.evicted for ld in loads])
        for ly, e, _slot in policy.pop_promotions():  # a step now waits on these prefetches
            await send(Promote(**st.stamp(), layer=ly, expert=e))

    async def handle(msg: PoolInbox) -> None:
        if emit is not None and not isinstance(msg, ReadsDone):  # the scheduler logs a ReadDone per read
            emit(msg)
        match msg:
            case Acquire(step=step, layer=layer, part=part, experts=experts):
                loads, ready = policy.acquire((step, layer, part), experts, msg.t)
                if policy.recall_samples:
                    for ly, used, predicted in policy.recall_samples:
                        if emit is not None:
                            emit(RecallSample(**st.stamp(), step=step, layer=ly, used=used, predicted=predicted))
                    policy.recall_samples.clear()
                await read(layer, loads)
                if ready is not None:
                    await grant(ready)
                elif msg.early:
                    early.add((step, layer, part))
                    if (there := policy.present((step, layer, part)))[0]:
                        await present((step, layer, part), *there)
            case ReadsDone(layers=layers, experts=experts, slots=slots):
                for layer, expert, slot in zip(layers, experts, slots, strict=True):
                    loads, grants = policy.read_done(layer, expert, slot)
                    for key, e, s in policy.pop_landed():
                        if key in early:
                            landed.setdefault(key, []).append((e, s))
                    await read(layer, loads)
                    for g in grants:
                        await grant(g)
            case Release(step=step, layer=layer, part=part):
                early.discard((step, layer, part))
                landed.pop((step, layer, part), None)
                policy.release((step, layer, part), msg.token_experts, msg.token_slots)
            case ForwardDone():
                policy.forward_done()
                if after_forward is not None:
                    after_forward()
            case PrefetchHint(step=step, source=source, layer=layer, experts=experts, scores=scores,
                              deadline=deadline):
                if loads := policy.prefetch(step, source, layer, list(zip(experts, scores, strict=True))):
                    await send(ReadExperts(**st.stamp(), layer=layer, experts=tuple(ld.expert for ld in loads),
                                           slots=tuple(ld.slot for ld in loads), cls=ReadClass.PREFETCH,
                                           deadline=deadline,
                                           scores=tuple(scores[experts.index(ld.expert)] for ld in loads)))
            case ReadExpired(layer=layer, expert=expert, slot=slot):
                if policy.read_expired(layer, expert, slot):
                    await send(ReadExperts(**st.stamp(), layer=layer, experts=(expert,), slots=(slot,)))

    async with inbox, to_reads, to_forward:
        by_layer: dict[int, list[Load]] = {}
        for layer, ld in preload:
            by_layer.setdefault(layer, []).append(ld)
        for layer, lds in by_layer.items():
            await read(layer, lds)
        task_status.started()
        async for first in inbox:
            # Whatever else is already waiting is handled in the same turn: one wake-up, not one per message.
            for msg in drain(inbox, first):
                await handle(msg)
            for key in list(landed):  # one Present per grant per burst of reads
                await flush(key)

