"""Miss attribution on MockClock: an oracle predictor with a fast device leaves only cold misses;
with a slow device every predicted miss is late. Plus a property test of the cause accounting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from qnpipe.actors.pipeline import open_pipeline
from qnpipe.config import Config, EvictPolicy, with_overrides
from qnpipe.errors import CapacityError
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.pool import MissKind, PoolOptions, PoolPolicy, PrefetchBudgets
from qnpipe.policy.read_queue import Job
from qnpipe.steps import LayerRoute, PartGrant, StepDone
from tests.profiles import examples

E, K, LAYERS = 32, 2, 6


def route(step: int, layer: int) -> tuple[int, ...]:
    if layer == 0:
        return (0, 1)  # resident after its first use: layer 0 has no earlier layer to predict it
    base = (step * 7 + layer * 5) % E
    return tuple(sorted({base, (base + 1) % E}))


class OracleBackend:
    """Routes by `route`, predicts the next layer's route exactly, and takes `compute_s` per layer."""

    def __init__(self, compute_s: float) -> None:
        self.compute_s = compute_s
        self.step = 0
        self.layer = 0

    def _route(self) -> LayerRoute:
        ids = np.array([route(self.step, self.layer)])
        preds = ()
        if self.layer + 1 < LAYERS:
            nxt = np.array([route(self.step, self.layer + 1)])
            preds = ((self.layer + 1, nxt, np.ones_like(nxt, dtype=np.float32)),)
        return LayerRoute(self.layer, ids, preds)

    async def begin(self, inputs: Any, cache: Any, tail: Any) -> Any:
        self.step += 1
        self.layer = 0
        return self._route()

    async def resume(self, grant: PartGrant) -> Any:
        await trio.sleep(self.compute_s)
        self.layer += 1
        return StepDone(None) if self.layer == LAYERS else self._route()

    async def abort(self) -> None:
        pass


class Device:
    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        await trio.sleep(self.latency_s)
        return [1] * len(jobs)

    def statistics(self) -> None:
        return None


def _run(latency_s: float, steps: int = 12, used: dict[int, int] | None = None) -> dict[int, dict[MissKind, int]]:
    """Each layer's miss causes; `used` gets each layer's experts acquired (so an empty cause set means something)."""
    cfg = with_overrides(Config(), {"predict.cross_layer_prefetch": True, "predict.ahead_layers": 1,
                                    "predict.width_experts": K, "pool.side_region_slots": 4,
                                    "pool.evict_policy": "lru"})

    async def main() -> dict[int, dict[MissKind, int]]:
        async with open_pipeline(cfg, OracleBackend(0.001), num_experts=E, capacities=dict.fromkeys(range(LAYERS), K),
                                 device=Device(latency_s), record_nbytes=dict.fromkeys(range(LAYERS), 1)) as p:
            for _ in range(steps):
                await p.forward.run(None, None, lambda h: None)
            assert p.policy is not None
            if used is not None:
                used.update({layer: c.used for layer, c in p.policy.counters.items()})
            return {layer: dict(c.causes) for layer, c in p.policy.counters.items()}

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_oracle_predictor_and_instant_device_leave_only_cold_misses() -> None:
    used: dict[int, int] = {}
    causes = _run(latency_s=0.0, used=used)
    assert causes[0] == {MissKind.COLD: 2}  # layer 0's two experts, once
    for layer in range(1, LAYERS):
        assert used[layer] > 0, layer  # the layer ran: no cause at all is a result, not an absence
        assert set(causes[layer]) <= {MissKind.COLD}, (layer, causes[layer])


def test_slow_device_makes_every_predicted_miss_late() -> None:
    causes = _run(latency_s=5.0, steps=6)
    for layer in range(1, LAYERS):
        assert causes[layer] and set(causes[layer]) == {MissKind.LATE}, (layer, causes[layer])


# more: the interleavings of reads and hints are many and each run is on MockClock
@examples(150)
@given(ops=st.lists(st.tuples(st.sampled_from(["acquire", "hint", "done", "expire", "forward"]),
                              st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True)),
                    max_size=60),
       persistent=st.booleans())
def test_every_miss_has_exactly_one_cause(ops: list[tuple[str, list[int]]], persistent: bool) -> None:
    """Random hints, acquires, read completions and expiries: causes always sum to misses, per layer."""
    options = PoolOptions(predicting=True, side_slots=3, side_persistent=persistent,
                          budgets=PrefetchBudgets(per_layer=2, global_reads=3, global_unused=3))
    policy = PoolPolicy.build({0: 3}, {0: make_eviction(EvictPolicy.LFU, 3)}, {0: 10}, options)
    reads: dict[int, int] = {}  # expert -> slot, issued and not finished
    step = 0
    for op, experts in ops:
        if op == "acquire":
            step += 1
            key = (step, 0, 0)
            try:
                acq = policy.acquire(key, experts, 0.0)
            except CapacityError:  # a full pool refuses; the books must still balance
                continue
            reads.update({ld.expert: ld.slot for ld in acq.loads})
            for _, e, _s in acq.promotions:
                assert e in reads
            while acq.ready is None and key in policy.pending:  # finish its reads, then release
                e = next(iter(policy.pending[key].missing))
                done = policy.read_done(0, e, reads.pop(e))
                reads.update({ld.expert: ld.slot for ld in done.loads})
                for _, pe, _s in done.promotions:
                    assert pe in reads
            policy.release(key)
        elif op == "hint":
            for ld in policy.prefetch(step + 1, -1, 0, [(e, 1.0) for e in experts]):
                reads[ld.expert] = ld.slot
        elif op == "done" and reads:
            e = min(reads)
            done = policy.read_done(0, e, reads.pop(e))
            reads.update({ld.expert: ld.slot for ld in done.loads})
            for _, pe, _s in done.promotions:
                assert pe in reads
        elif op == "expire" and reads:
            e = max(reads)
            if reads[e] >= 3 and not policy.read_expired(0, e, reads[e]):  # a prefetch, not a demand
                reads.pop(e)
        elif op == "forward":
            policy.forward_done()
        c = policy.counters[0]
        assert sum(c.causes.values()) == c.misses
        assert c.hits + c.misses == c.used
        assert policy.tables[0].occupancy <= 3 and policy.sides[0].occupancy <= 3
