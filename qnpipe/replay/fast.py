"""Replay's heap driver: the pipeline's cores run by a plain loop over virtual time, no trio.

The same decisions as the actor driver (qnpipe.replay.runner with `driver="actors"`): the
pool (`PoolCore`), the read scheduler (`ReadCore`), the predictor (`Hinter`), the forward's
pace (`Pace`) and parts (`plan_parts`), the simulated device (`DeviceModel`), taken in the
one order qnpipe.policy.turn_order defines: at each instant the forward and the device act
first, then the actors take turns, lowest `(rank, key)` first, each with its whole inbox;
then time moves to the next event. The forward is a generator that yields what it waits
for (a grant, or its compute's end), so its step loop reads as the actor's does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator, Sequence
from typing import Any

import attrs
import numpy as np

from qnpipe.config import Config
from qnpipe.errors import StallError
from qnpipe.io.sim_model import DeviceModel, DeviceProfile
from qnpipe.messages import (
    Acquire,
    Candidates,
    ForwardDone,
    Granted,
    Msg,
    PoolInbox,
    ReadInbox,
    Release,
)
from qnpipe.policy.build import make_policy
from qnpipe.policy.hinter import Hinter
from qnpipe.policy.pace import Pace
from qnpipe.policy.parts import plan_parts_flat
from qnpipe.policy.pool import PoolPolicy, PoolStatistics
from qnpipe.policy.pool_core import Outbox, PoolCore
from qnpipe.policy.predict import hint_top
from qnpipe.policy.read_core import Batch, ReadCore
from qnpipe.policy.read_queue import ReadQueue
from qnpipe.trace.format import UnionSize, route_record

Predictions = tuple[tuple[int, np.ndarray, np.ndarray], ...]


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
    """One replay run (see the module doc); `run()` once."""

    def __init__(self, steps: list[list[tuple[int, tuple[int, ...]]]], top_k: int, num_experts: int, cfg: Config, *,
                 capacities: dict[int, int], record_nbytes: dict[int, int], per_layer_s: float,
                 per_token_s: float, per_step_s: float, read_hop_s: float, layer_table: dict[int, float],
                 per_miss_s: float = 0.0,
                 profile: DeviceProfile, predictions: list[list[Predictions]] | None,
                 emit: Callable[[Msg], None] | None = None) -> None:
        self.steps = steps
        self.k = top_k
        self.num_experts = num_experts
        self.caps = capacities
        self.policy: PoolPolicy = make_policy(cfg, capacities, record_nbytes)
        logging = emit is not None
        self.emit = emit
        self.pool = PoolCore(self.policy, logging=logging)
        queue = ReadQueue(cfg.read.workers, batch=cfg.read.batch_miss_read,
                          max_prefetch_in_flight=cfg.read.bg_budget_experts or None)
        self.reads = ReadCore(queue, logging=logging)
        self.dev = DeviceModel(profile, hop_s=read_hop_s)
        self.nbytes = record_nbytes
        self.hinter = Hinter(cfg.predict, hint_top(cfg.predict)) if cfg.predict.cross_layer_prefetch else None
        self.preds = predictions if self.hinter is not None else None
        self.route_verify = cfg.diag.route_verify
        self.union_prof = cfg.diag.union_prof and logging
        self.pace = Pace(dict(self.policy.moe_order))
        self.per_layer_s, self.per_token_s, self.per_step_s = per_layer_s, per_token_s, per_step_s
        self.layer_table = layer_table
        self.per_miss_s = per_miss_s
        # The actor driver's channel bounds where a full channel drops (qnpipe.actors.pipeline): a
        # receiver holds the message it woke on, so a channel holds one more than its buffer.
        self.pool_cap = sum(capacities.values()) + 4 + 1
        self.cand_cap = 4 * len(capacities) + 8 + 1
        self.now = 0.0
        self.seq = 0
        self.stall_s = 0.0
        self.tokens = 0
        self.candidates_dropped = 0
        # The pool's inbox by sender (forward, read scheduler, predictor): within one instant every message
        # has the same `t`, so taking them in this order is the turn order (qnpipe.policy.turn_order).
        self.pool_inbox: list[PoolInbox] = []
        self.pool_from_reads: list[PoolInbox] = []
        self.pool_from_predictor: list[PoolInbox] = []
        self.reads_inbox: list[ReadInbox] = []
        self.cand_inbox: list[Candidates] = []
        self.granted: dict[tuple[int, int, int], Granted] = {}
        self.done_batches: list[int] = []
        self.batches: dict[int, tuple[Batch, list[int]]] = {}  # on the device: the batch and its reads' sizes

    def _stamp(self) -> int:
        self.seq += 1
        return self.seq

    def _layer_s(self, tokens: int, layer: int, misses: int) -> float:
        # CostModel.layer_s's arithmetic, in its order: the actor driver's sleeps, to the bit
        s = self.layer_table.get(layer, self.per_layer_s) + self.per_token_s * tokens
        return s + self.per_miss_s * misses if misses and self.per_miss_s else s

    # ------------------------------------------------------------------ the forward

    def forward(self) -> Generator[tuple[int, Any], Any, None]:
        """The forward's step loop over the log (qnpipe.actors.forward.Forward with replay's LogBackend)."""
        k, emit, pool_inbox = self.k, self.emit, self.pool_inbox
        need_ids = emit is not None or self.route_verify  # the route record and route verification take arrays
        for i_step, step in enumerate(self.steps):
            fstep = i_step + 1
            self.pace.new_step()
            self.tokens += len(step[0][1]) // k
            if self.per_step_s:
                yield _SLEEP, self.per_step_s
            for i, (layer, experts) in enumerate(step):
                now = self.now
                self.pace.observe(now)
                if self.preds is not None:
                    self._candidates(fstep, layer, self.preds[i_step][i])
                ids = np.asarray(experts, dtype=np.int64).reshape(-1, k) if need_ids else None
                if emit is not None:
                    assert ids is not None
                    emit(route_record({"t": now, "seq": self._stamp()}, fstep, layer, ids, None))
                parts = plan_parts_flat(experts, k, self.caps[layer], layer=layer)
                if self.union_prof:
                    assert emit is not None
                    emit(UnionSize(t=now, seq=self._stamp(), step=fstep, layer=layer, tokens=len(experts) // k,
                                   union=len({e for _, _, ex in parts for e in ex})))
                lut = np.full(self.num_experts, -1, dtype=np.int64) if self.route_verify else None
                for p, (lo, hi, part_experts) in enumerate(parts):
                    t0 = self.now
                    pool_inbox.append(Acquire(t=t0, seq=self._stamp(), step=fstep, layer=layer, part=p,
                                              experts=part_experts))
                    g: Granted = yield _GRANT, (fstep, layer, p)
                    if g.misses:
                        self.stall_s += self.now - t0
                    yield _SLEEP, self._layer_s(hi - lo, layer, g.misses)
                    if lut is not None:
                        assert ids is not None
                        lut[list(g.experts)] = g.slots
                        tok = ids[lo:hi]
                        pool_inbox.append(Release(t=self.now, seq=self._stamp(), step=fstep, layer=layer, part=p,
                                                  token_experts=tuple(tok.reshape(-1).tolist()),
                                                  token_slots=tuple(lut[tok].reshape(-1).tolist())))
                    else:
                        pool_inbox.append(Release(t=self.now, seq=self._stamp(), step=fstep, layer=layer, part=p))
            pool_inbox.append(ForwardDone(t=self.now, seq=self._stamp(), step=fstep))

    def _candidates(self, fstep: int, layer: int, preds: Predictions) -> None:
        now = self.now
        for target, ids, probs in preds:
            c = Candidates(t=now, seq=self._stamp(), step=fstep, layer=layer, target=target, width=ids.shape[-1],
                           token_experts=tuple(ids.reshape(-1).tolist()),
                           token_scores=tuple(probs.reshape(-1).tolist()),
                           deadline=self.pace.deadline(now, layer, target))
            if self.emit is not None:
                self.emit(c)
            if len(self.cand_inbox) < self.cand_cap:
                self.cand_inbox.append(c)
            else:  # advisory: a busy predictor loses the hint, the forward never waits
                self.candidates_dropped += 1

    # ------------------------------------------------------------------ the actors' turns

    def _deliver(self, out: Outbox, batches: Sequence[Batch] = ()) -> None:
        if self.emit is not None:
            for r in out.log:
                self.emit(r)
        self.reads_inbox += out.reads
        for g in out.forward:
            assert isinstance(g, Granted), g  # replay asks for no early grants
            self.granted[(g.step, g.layer, g.part)] = g
        self.pool_from_reads += out.pool
        for b in batches:
            sizes = [self.nbytes[j.layer] for j in b.jobs]
            self.batches[b.number] = (b, sizes)
            self.dev.submit(b.number, sizes, self.now)

    def _turn(self) -> bool:
        """Take the next wanted turn; False when none is wanted."""
        now = self.now
        if self.done_batches:
            number = heapq.heappop(self.done_batches)
            b, sizes = self.batches.pop(number)
            out = Outbox()
            more = self.reads.complete(b, sizes, now, out)
            self._deliver(out, more)
        elif self.pool_inbox or self.pool_from_reads or self.pool_from_predictor:
            msgs = self.pool_inbox + self.pool_from_reads + self.pool_from_predictor
            self.pool_inbox.clear()
            self.pool_from_reads.clear()
            self.pool_from_predictor.clear()
            out = Outbox()
            for m in msgs:
                self.pool.handle(m, now, out)
            self.pool.end_turn(now, out)
            self._deliver(out)
        elif self.reads_inbox:
            out = Outbox()
            for r in self.reads_inbox:
                self.reads.handle(r, now, out)
            self.reads_inbox.clear()
            self._deliver(out, self.reads.dispatch(now, out))
        elif self.cand_inbox:
            assert self.hinter is not None
            cands = list(self.cand_inbox)
            self.cand_inbox.clear()
            for c in cands:
                hint = self.hinter.hint(c, now)
                if hint is None:
                    continue
                if len(self.pool_inbox) + len(self.pool_from_reads) + len(self.pool_from_predictor) >= self.pool_cap:
                    hint = None
                else:
                    self.pool_from_predictor.append(hint)
                self.hinter.sent(hint)
        else:
            return False
        return True

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        fwd = self.forward()
        kind, arg = next(fwd)
        wake = self.now + arg if kind == _SLEEP else math.inf
        dev = self.dev
        while True:
            # What is not a turn acts first: the forward (its compute ended, or its grant came) and the device.
            if (kind == _SLEEP and wake <= self.now) or (kind == _GRANT and arg in self.granted):
                try:
                    kind, arg = fwd.send(None if kind == _SLEEP else self.granted.pop(arg))
                except StopIteration:
                    break
                wake = self.now + arg if kind == _SLEEP else math.inf
                continue
            if dev.next_time() <= self.now:
                for number in dev.advance(self.now):
                    heapq.heappush(self.done_batches, number)
                continue
            if self._turn():
                continue
            t = min(wake, dev.next_time())
            if t == math.inf:
                raise StallError(f"replay: the forward waits for grant {arg} and nothing is due: "
                                 f"pool pending {sorted(self.policy.pending)}, deferred {sorted(self.policy.deferred)}")
            self.now = t
        return RunResult(pool=self.policy.statistics(), stall_s=self.stall_s, elapsed_s=self.now,
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
