"""The wiring: build the pool's policy, open the channels, start the actors.

`open_pipeline` starts the pool, read-scheduler and predictor actors in one nursery and
returns the forward that drives them, over whatever backend (the MLX model, or replay's
recorded routes) and device (the SSD reader, or replay's simulated SSD) it is given:

    forward ──Acquire/Release/ForwardDone──▶ pool ──ReadExperts──▶ read_scheduler ──▶ device
       ▲                                      │  ▲                       │
       └─────────Present, Granted─────────────┘  └──────ReadsDone────────┘

When every expert is resident (`pool.eager_load`, or a model directory without an
expert store) there are no actors: the forward runs the model straight through. The live
model side (loading, slot arrays, the MLX-thread backend) is qnpipe.live.loaded; this module
imports no MLX model code, so replay starts fast.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio
import trio.testing

from qnpipe.actors.autopin import Autopin
from qnpipe.actors.forward import Forward
from qnpipe.actors.pool import InlinePool, PoolInline, pool
from qnpipe.actors.predictor import PredictorStats, predictor
from qnpipe.actors.read_scheduler import ReadSchedulerStats, ReadsInline, read_scheduler
from qnpipe.actors.recorder import Emit, Emitter, open_recording
from qnpipe.actors.turns import Turnstile
from qnpipe.config import Config
from qnpipe.errors import CapacityError, StallError, root_cause
from qnpipe.io.device import ExpertDevice
from qnpipe.messages import Candidates, ForwardInbox, PoolInbox, ReadInbox
from qnpipe.policy import turn_order
from qnpipe.policy.build import layer_capacities, make_policy, side_slots
from qnpipe.policy.forward_core import forward_capacities
from qnpipe.policy.pool import PoolPolicy
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.predict import hint_top
from qnpipe.policy.read_core import read_queue
from qnpipe.policy.read_queue import ReadQueue
from qnpipe.stats_snapshot import LayerTable, PipelineStatistics, PredictorStatistics, ReadStatistics
from qnpipe.trace import ModelShape
from qnpipe.trace.format import RunPart

# Hits answered in the forward's turn (qnpipe.actors.pool.InlinePool). False sends every message by
# channel, as before: the tests that compare the two ways and tools/bench_stream.py's before/after set it.
_inline_hits = True
# The read scheduler's and the pool's turns over the miss path taken where their messages are made, when the
# actor is idle (qnpipe.actors.read_scheduler.ReadsInline, qnpipe.actors.pool.PoolInline). False: by channel, as
# before; the tests that compare the two ways and tools/bench_stream.py's before/after set it.
_inline_reads = True
# With `_inline_reads`, an acquire with misses is taken in the forward's task too when the pool and the read
# scheduler are both idle (qnpipe.actors.pool.InlinePool.answer_reads). False: by channel (A/B benchmarks).
_inline_acquires = True


@attrs.define
class Pipeline:
    """A running pipeline: the forward to drive, and the actors' state to report on (`statistics()`)."""

    forward: Forward
    policy: PoolPolicy | None = None
    read_stats: ReadSchedulerStats | None = None
    device: ExpertDevice | None = None
    predictor_stats: PredictorStats | None = None
    autopin: Autopin | None = None
    recording: Emitter | None = None  # the recorders' emitter when a trace is written (statistics())
    read_queue: ReadQueue | None = None  # the read scheduler's queue: it counts merged reads and the peak in flight

    def statistics(self) -> PipelineStatistics:
        """Every actor's figures now, frozen: each copied from the one actor that counts it."""
        forward = self.forward.core.statistics()
        pol, rs, ps, queue = self.policy, self.read_stats, self.predictor_stats, self.read_queue
        if pol is None:
            return PipelineStatistics(forward=forward)
        assert rs is not None and queue is not None
        return PipelineStatistics(
            forward=forward, pool=pol.statistics(), predicting=pol.predicting,
            tables=tuple(LayerTable(layer=layer, capacity=t.capacity, occupancy=t.occupancy, pinned=len(t.pinned))
                         for layer, t in sorted(pol.tables.items())),
            reads=ReadStatistics(requests=rs.requests, merged=queue.merged, batches=rs.batches, reads=rs.reads,
                                 bytes_read=rs.bytes_read, device_s=rs.device_s, peak_in_flight=queue.peak_in_flight,
                                 promoted=rs.promoted, expired=rs.expired),
            predictor=None if ps is None else PredictorStatistics(
                candidates=ps.candidates, hints=ps.hints, hints_dropped_full=ps.hints_dropped_full,
                experts_hinted=ps.experts_hinted),
            device=self.device.statistics() if self.device is not None else None)


async def watchdog(fwd: Forward, limit_s: float, dump: Callable[[], str], *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Raise StallError when a step in progress has not moved for `limit_s` (SGLang's soft watchdog).

    A silent deadlock thus becomes an error with every actor's state attached. Under a virtual
    clock (replay's MockClock) the seconds are the simulation's: a read of an hour on a slow
    simulated device is a result, not a stall, so there only a deadlock counts: no progress
    while nothing else is due (no deadline but this task's own).
    """
    task_status.started()
    virtual = isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock)
    last, since = fwd.progress, trio.current_time()
    while True:
        nap, nxt = limit_s / 4, trio.lowlevel.current_statistics().seconds_to_next_deadline
        # In virtual time, waking before what is due next would only make the clock stop for nothing
        # (a simulated read of 10^4 s would cost 10^4 wake-ups).
        await trio.sleep(max(nap, nxt) if virtual and nxt < math.inf else nap)
        if virtual:  # look once what was due with this wake-up has run
            await trio.testing.wait_all_tasks_blocked()
        now = trio.current_time()
        due = virtual and trio.lowlevel.current_statistics().seconds_to_next_deadline < math.inf
        if not fwd.busy or fwd.progress != last or due:
            last, since = fwd.progress, now
            continue
        if now - since >= limit_s:
            raise StallError(f"no progress for {now - since:.1f} s (diag.watchdog_s={limit_s}): {dump()}")


def _dump(policy: PoolPolicy, queue: ReadQueue, rstats: ReadSchedulerStats, pstats: PredictorStats) -> str:
    return (f"pool: pending {sorted(policy.pending)}, deferred {sorted(policy.deferred)}, held {sorted(policy.held)}, "
            f"prefetch reads out {policy.prefetch_reads_out}; read queue: {len(queue.queued)} queued, "
            f"{len(queue.in_flight)} in flight {sorted(queue.in_flight)}, {queue.merged} merged, peak in flight "
            f"{queue.peak_in_flight}; read scheduler {rstats}; predictor {pstats}")


@asynccontextmanager
async def open_pipeline(cfg: Config, backend: Any, *, num_experts: int, capacities: dict[int, int] | None,
                        device: ExpertDevice | None, record_nbytes: dict[int, int] | None = None,
                        check_bytes: Callable[[int, tuple[int, ...], tuple[int, ...]], Awaitable[None]] | None = None,
                        autopin: Autopin | None = None, shape: ModelShape | None = None,
                        wall_start_unix_s: float = 0.0, turns: Turnstile | None = None,
                        run: RunPart | None = None) -> AsyncIterator[Pipeline]:
    """Start the actors (none when `capacities` is None: all resident) and yield the pipeline.

    With `trace.event_log_path` (or `trace.route_trace`) set, a recorder per log gets every
    actor's events (qnpipe.actors.recorder); `shape` and `run` (a distributed rank's) go in the log's header.

    With `autopin`, the pool counts routing heat, starts with each layer's hottest experts
    pinned (their reads issued before the first step), and the heat is saved every
    `pool.autopin_save_every_forwards` forwards and when the block is left. The forward's
    capacity of a layer is its capacity minus its pins: a step can always get that many.

    `turns`: replay's turnstile (qnpipe.actors.turns), which runs the actors' turns in the one
    order qnpipe.policy.turn_order defines; None live.

    An actor that fails stops the others; the forward then raises its error (e.g.
    `ReadError`) to whoever is generating. Leaving the block stops every actor.
    """
    # A layer-step emits a few records per expert it reads, and the forward yields to the
    # recorder at least once per layer-step: 8 per slot (at least 4096) never fills.
    size = max(4096, 8 * sum((capacities or {}).values()))
    async with open_recording(cfg, shape=shape, capacities=capacities, channel_size=size,
                              wall_start_unix_s=wall_start_unix_s, run=run) as emit:
        async with _open_actors(cfg, backend, num_experts=num_experts, capacities=capacities, device=device,
                                record_nbytes=record_nbytes, check_bytes=check_bytes, autopin=autopin,
                                emit=emit, turns=turns) as p:
            p.recording = emit
            yield p


@asynccontextmanager
async def _open_actors(cfg: Config, backend: Any, *, num_experts: int, capacities: dict[int, int] | None,
                       device: ExpertDevice | None, record_nbytes: dict[int, int] | None,
                       check_bytes: Callable[[int, tuple[int, ...], tuple[int, ...]], Awaitable[None]] | None,
                       autopin: Autopin | None, emit: Emit | None,
                       turns: Turnstile | None) -> AsyncIterator[Pipeline]:
    if capacities is None:
        yield Pipeline(Forward(backend, None, None, {}, num_experts))
        return
    assert device is not None and record_nbytes is not None
    # The bounds are proven (qnpipe.policy.turn_order), not hoped.
    pool_tx, pool_rx = trio.open_memory_channel[PoolInbox](turn_order.pool_inbox_size(capacities))
    read_tx, read_rx = trio.open_memory_channel[ReadInbox](turn_order.reads_inbox_size(capacities))
    grant_tx, grant_rx = trio.open_memory_channel[ForwardInbox](turn_order.GRANTS_SIZE)
    policy = make_policy(cfg, capacities, record_nbytes, autopin.heat if autopin is not None else None)
    preloads = []
    if autopin is not None:
        for layer, experts in autopin.plan(capacities).items():
            preloads += [(layer, ld) for ld in policy.preload(layer, experts)]
    pass_caps = forward_capacities(capacities, policy)
    rstats = ReadSchedulerStats()
    pstats = PredictorStats()
    predicting = cfg.predict.cross_layer_prefetch
    # Advisory edge: a full inbox drops, never blocks.
    cand_tx, cand_rx = trio.open_memory_channel[Candidates](turn_order.candidates_size(capacities))
    fwd = Forward(backend, pool_tx, grant_rx, pass_caps, num_experts, route_verify=cfg.diag.route_verify,
                  to_predictor=cand_tx if predicting else None, moe_order=dict(policy.moe_order),
                  check_bytes=check_bytes, emit=emit, union_prof=cfg.diag.union_prof,
                  by_expert=cfg.forward.parts == "experts",
                  # a backend that can start a layer's experts before all are read says for how many pairs
                  early_pairs=getattr(backend, "early_pairs", 0) if cfg.forward.early_grants else 0)
    pool_core = PoolCore(policy, logging=emit is not None)
    if _inline_hits:
        fwd.use_inline(InlinePool(pool_core, pool_rx, grant_rx, emit, fwd.failure))
    reads_inline = pool_inline = None
    if _inline_reads and turns is None:
        reads_inline, pool_inline = ReadsInline(read_rx), PoolInline(pool_rx)
        reads_inline.pool_idle = pool_inline.idle
        fwd.reads_first = False  # the pool puts an early grant's reads on the device before it answers
        if fwd.inline is not None and _inline_acquires:
            fwd.inline.reads = reads_inline  # an acquire with misses, taken in the forward's turn
    scopes: list[trio.CancelScope] = []
    try:
        async with trio.open_nursery() as nursery:

            async def supervised(actor: Callable[..., Awaitable[None]], *,
                                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                # Not the nursery's scope: that would cancel the caller's code inside the block too.
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    try:
                        await actor(task_status=task_status)
                    # Handed to the forward; the other actors stop with it. Ctrl-C and SIGTERM's SystemExit too:
                    # in replay (trio in the main thread) they land in the actor running a plug-in's call.
                    except (Exception, KeyboardInterrupt, SystemExit) as e:
                        fwd.failure.append(root_cause(e))
                        for sc in scopes:
                            sc.cancel()

            queue = read_queue(cfg)
            if cfg.diag.watchdog_s > 0:
                await nursery.start(supervised, partial(watchdog, fwd, cfg.diag.watchdog_s,
                                                        lambda: _dump(policy, queue, rstats, pstats)))
            after_forward = None
            if autopin is not None:
                await nursery.start(autopin.run_saver)
                after_forward = autopin.after_forward
            if turns is not None:
                await nursery.start(turns.run)
            async def pool_actor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                # The pool works on clones: the forward sees its channels close only once `supervised` has
                # recorded the pool's error, so it raises that error (a PluginError, a RouteError), not
                # "the expert pipeline stopped (EndOfChannel)".
                async with pool_rx, grant_tx:
                    await supervised(partial(pool, pool_rx.clone(), read_tx, grant_tx.clone(), policy=policy,
                                             preload=preloads, after_forward=after_forward, emit=emit,
                                             turns=turns, core=pool_core, inline=pool_inline,
                                             reads_inline=reads_inline), task_status=task_status)

            await nursery.start(pool_actor)
            if predicting:
                await nursery.start(supervised, partial(predictor, cand_rx, pool_tx.clone(), predict_cfg=cfg.predict,
                                                        top=hint_top(cfg.predict), stats=pstats, turns=turns))
            await nursery.start(supervised, partial(read_scheduler, read_rx, pool_tx.clone(), device=device,
                                                    queue=queue, stats=rstats, emit=emit, turns=turns,
                                                    inline=reads_inline,
                                                    pool_inline=pool_inline.take if pool_inline else None,
                                                    pool_inline_now=pool_inline.take_now if pool_inline else None))
            try:
                yield Pipeline(fwd, policy, rstats, device, pstats, autopin, read_queue=queue)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if autopin is not None:  # after the saver stopped: one writer at a time
            await autopin.save_final()


__all__ = ["CapacityError", "Pipeline", "layer_capacities", "make_policy", "open_pipeline", "side_slots"]
