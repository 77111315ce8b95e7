"""Replay's heap driver: the pipeline's cores run by a plain loop over virtual time, no trio.

The same decisions as the actor driver (qnpipe.replay.runner with `driver="actors"`): the
forward (`ForwardCore`), the pool (`PoolCore`), the read scheduler (`ReadCore`), the
predictor (`Hinter`), the simulated device (`DeviceModel`), taken in the one order
qnpipe.policy.turn_order defines: at each instant the forward and the device act first,
then the actors take turns, lowest `(rank, key)` first, each with its whole inbox; then
time moves to the next event. The forward is a generator that yields what it waits for (a
grant, or its compute's end), so its step loop reads as the actor's does. Only the loop is
here: every decision is a core's.

As the live forward does (qnpipe.actors.pool.InlinePool), an acquire the pool grants at once
is answered in the forward's own action when nothing else waits for the pool and nothing
for the forward: the turn the pool would take next, taken before the other actors' turns
of the instant (the actor driver under replay's turnstile does exactly that), and a layer's
last `Release` goes with the next message (`ForwardCore.hold_last_release`), as there.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

import attrs

from qnpipe.config import Config
from qnpipe.errors import StallError
from qnpipe.io.sim_model import DeviceModel, DeviceProfile
from qnpipe.messages import Acquire, Candidates, ForwardInbox, Msg, PoolInbox, ReadInbox
from qnpipe.policy import turn_order
from qnpipe.policy.build import make_policy
from qnpipe.policy.forward_core import ForwardCore, Predictions, forward_capacities
from qnpipe.policy.hinter import Hinter
from qnpipe.policy.outbox import Batch, Outbox
from qnpipe.policy.pool import PoolPolicy, PoolStatistics
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.predict import hint_top
from qnpipe.policy.read_core import BatchDone, ReadCore, read_queue


class Cost(Protocol):
    """The modelled compute (qnpipe.replay.runner.CostModel): the actor driver's backend sleeps the same."""

    @property
    def per_step_s(self) -> float: ...

    @property
    def read_hop_s(self) -> float: ...

    def layer_s(self, tokens: float, layer: int | None = None, misses: int = 0) -> float: ...


@attrs.frozen
class RunResult:
    """What a driver measured: the pool's figures, the forward's stall, the virtual time and the device's."""

    pool: PoolStatistics
    stall_s: float
    elapsed_s: float
    busy_s: float
    device_reads: int
    device_bytes: int
    tokens: int


_SLEEP, _GRANT = 0, 1


class FastReplay:
    """One replay run (see the module doc); `run()` once.

    `pins`: experts placed and pinned before the first step, per layer (as autopin does); the
    forward's capacity is then the layer's minus its pins. `early_pairs`: the forward asks for
    early grants as the actor driver's does for a backend with that many (the early work is
    queued at no cost: a part's modelled compute runs at its full grant, as replay's backend's).
    """

    def __init__(self, steps: list[list[tuple[int, tuple[int, ...]]]], top_k: int, num_experts: int, cfg: Config, *,
                 capacities: dict[int, int], record_nbytes: dict[int, int], cost: Cost, profile: DeviceProfile,
                 predictions: list[list[Predictions]] | None, emit: Callable[[Msg], None] | None = None,
                 pins: Mapping[int, Sequence[int]] | None = None, early_pairs: int = 0) -> None:
        self.steps = steps
        self.k = top_k
        self.policy: PoolPolicy = make_policy(cfg, capacities, record_nbytes)
        preloads = [(layer, ld) for layer, experts in (pins or {}).items()
                    for ld in self.policy.preload(layer, experts)]
        logging = emit is not None
        self.emit = emit
        self.pool = PoolCore(self.policy, logging=logging)
        self.reads = ReadCore(read_queue(cfg), logging=logging)
        self.dev = DeviceModel(profile, hop_s=cost.read_hop_s)
        self.nbytes = record_nbytes
        self.hinter = Hinter(cfg.predict, hint_top(cfg.predict)) if cfg.predict.cross_layer_prefetch else None
        self.preds = predictions if self.hinter is not None else None
        self.core = ForwardCore(forward_capacities(capacities, self.policy), num_experts, dict(self.policy.moe_order),
                                early_pairs=early_pairs if cfg.forward.early_grants else 0,
                                route_verify=cfg.diag.route_verify, slots=False, logging=logging,
                                union_prof=cfg.diag.union_prof and logging, hold_last_release=True,
                                by_expert=cfg.forward.parts == "experts")
        self.cost = cost
        # Where the actor driver's full channels drop an advisory message.
        self.pool_cap = turn_order.holds(turn_order.pool_inbox_size(capacities))
        self.cand_cap = turn_order.holds(turn_order.candidates_size(capacities))
        self.now = 0.0
        self.tokens = 0
        # The pool's inbox by sender (forward, read scheduler, predictor): within one instant every message
        # has the same `t`, so taking them in this order is the turn order (qnpipe.policy.turn_order).
        self.pool_inbox: list[PoolInbox] = []
        self.pool_from_reads: list[PoolInbox] = []
        self.pool_from_predictor: list[PoolInbox] = []
        self.reads_inbox: list[ReadInbox] = []
        self.cand_inbox: list[Candidates] = []
        self.to_forward: deque[ForwardInbox] = deque()
        self.done_batches: list[int] = []
        self.batches: dict[int, tuple[Batch, list[int]]] = {}  # on the device: the batch and its reads' sizes
        # The actors' turns, lowest rank first (turn_order); each takes its turn if it wants one.
        turns = {turn_order.READS_DONE: self._reads_done_turn, turn_order.POOL: self._pool_turn,
                 turn_order.READS: self._reads_turn, turn_order.PREDICTOR: self._predictor_turn}
        self._turns = [turns[rank] for rank in sorted(turn_order.RANKS)]
        self._deliver(self.pool.preload(preloads, self.now))

    # ------------------------------------------------------------------ the forward

    def forward(self) -> Generator[tuple[int, Any], Any, None]:
        """The forward's step loop over the log (qnpipe.actors.forward.Forward with replay's LogBackend)."""
        k, core, cost, to_pool = self.k, self.core, self.cost, self._to_pool
        for i_step, step in enumerate(self.steps):
            core.begin_step()
            self.tokens += len(step[0][1]) // k
            if cost.per_step_s:
                yield _SLEEP, cost.per_step_s
            for i, (layer, experts) in enumerate(step):
                out = core.route(layer, experts, k, self.now,
                                 predictions=self.preds[i_step][i] if self.preds is not None else (),
                                 room=self.cand_cap - len(self.cand_inbox))
                if self.emit is not None:
                    for r in out.log:
                        self.emit(r)
                self.cand_inbox += out.predictor
                to_pool(out.pool)
                while True:
                    run = core.handle((yield _GRANT, None), self.now).run
                    if run is None or run.early:  # early work is queued, not timed (replay's backend)
                        continue
                    yield _SLEEP, cost.layer_s(run.tokens, layer, run.misses)
                    to_pool(core.part_done(self.now).pool)
                    if run.last:
                        break
            to_pool(core.end_step(self.now).pool)

    def _to_pool(self, msgs: list[PoolInbox]) -> None:
        """The forward's messages to the pool: answered at once (`PoolCore.answers_at_once`) when the pool
        and the forward have nothing waiting, as the live forward's `InlinePool.answer`; else queued."""
        if not msgs:
            return
        inbox = self.pool_inbox
        acq = msgs[-1]
        if (not inbox and not self.pool_from_reads and not self.pool_from_predictor and not self.to_forward
                and isinstance(acq, Acquire) and self.pool.answers_at_once(acq)):
            self._deliver(self.pool.turn(msgs, self.now))
        else:
            inbox += msgs

    # ------------------------------------------------------------------ the actors' turns

    def _deliver(self, out: Outbox) -> None:
        if self.emit is not None:
            for r in out.log:
                self.emit(r)
        if out.reads:
            self.reads_inbox += out.reads
        if out.forward:
            self.to_forward += out.forward
        if out.pool:
            self.pool_from_reads += out.pool  # the read scheduler's: the pool's core sends none to itself
        for b in out.batches:
            sizes = [self.nbytes[j.layer] for j in b.jobs]
            self.batches[b.number] = (b, sizes)
            self.dev.submit(b.number, sizes, self.now)

    def _reads_done_turn(self, now: float) -> bool:
        if not self.done_batches:
            return False
        b, sizes = self.batches.pop(heapq.heappop(self.done_batches))
        self._deliver(self.reads.turn((BatchDone(b, sizes),), now))
        return True

    def _pool_turn(self, now: float) -> bool:
        if not (self.pool_inbox or self.pool_from_reads or self.pool_from_predictor):
            return False
        msgs = self.pool_inbox + self.pool_from_reads + self.pool_from_predictor
        self.pool_inbox.clear()
        self.pool_from_reads.clear()
        self.pool_from_predictor.clear()
        self._deliver(self.pool.turn(msgs, now))
        return True

    def _reads_turn(self, now: float) -> bool:
        if not self.reads_inbox:
            return False
        msgs, self.reads_inbox = self.reads_inbox, []
        self._deliver(self.reads.turn(msgs, now))
        return True

    def _predictor_turn(self, now: float) -> bool:
        if not self.cand_inbox:
            return False
        assert self.hinter is not None
        cands, self.cand_inbox = self.cand_inbox, []
        self.hinter.room = self.pool_cap - len(self.pool_inbox) - len(self.pool_from_reads) - len(
            self.pool_from_predictor)
        self.pool_from_predictor += self.hinter.turn(cands, now).pool
        return True

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        fwd = self.forward()
        kind, arg = next(fwd)
        wake = self.now + arg if kind == _SLEEP else math.inf
        dev, turns, to_forward = self.dev, self._turns, self.to_forward
        while True:
            # What is not a turn acts first: the forward (its compute ended, or its grant came) and the device.
            if (kind == _SLEEP and wake <= self.now) or (kind == _GRANT and to_forward):
                try:
                    kind, arg = fwd.send(None if kind == _SLEEP else to_forward.popleft())
                except StopIteration:
                    break
                wake = self.now + arg if kind == _SLEEP else math.inf
                continue
            if dev.next_time() <= self.now:
                for number in dev.advance(self.now):
                    heapq.heappush(self.done_batches, number)
                continue
            for take in turns:  # the next wanted turn
                if take(self.now):
                    break
            else:
                t = min(wake, dev.next_time())
                if t == math.inf:
                    raise StallError(f"replay: the forward waits for a grant and nothing is due: "
                                     f"pool pending {sorted(self.policy.pending)}, "
                                     f"deferred {sorted(self.policy.deferred)}")
                self.now = t
        return RunResult(pool=self.pool.statistics(), stall_s=self.core.stats.stall_s, elapsed_s=self.now,
                         busy_s=dev.busy_s(self.now), device_reads=dev.stats.reads, device_bytes=dev.stats.bytes_read,
                         tokens=self.tokens)

    def reads_drained_t(self) -> float:
        """When the reads still on the device at the end have finished (after `run`; consumes the device).

        The actor driver's pipeline waits for them as it closes (a read in service finishes, as on the
        real device), so that is when its event log ends (the footer's `clock_end_t`)."""
        t = self.now
        while not self.dev.idle():
            t = self.dev.next_time()
            self.dev.advance(t)
        return t


__all__ = ["FastReplay", "RunResult"]
