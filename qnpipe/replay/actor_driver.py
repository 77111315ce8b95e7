"""Replay's actor driver (`driver="actors"`): the live trio actors on a virtual clock, the reference the
fast driver (qnpipe.replay.fast) is held to, report for report (tests/replay/test_drivers.py).

The log's `trace.route` records drive a `LogBackend` (the forward's `Backend` seam) step by step;
each layer's compute is modelled (`await trio.sleep(cost)`), reads go to a `SimSSD`, and the run
happens under trio's MockClock (style §7.4): no model, no MLX work, no threads. The pool and read
scheduler are the live actors (`qnpipe.actors.pipeline.open_pipeline`), so hit rates and miss causes
are the policy's own. Only this module of the replay imports trio and the actors: the fast driver's
runs never load them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from qnpipe.actors.pipeline import open_pipeline
from qnpipe.actors.turns import Turnstile, exact_clock
from qnpipe.config import Config
from qnpipe.errors import QnpipeError
from qnpipe.io.simssd import DeviceProfile, open_simssd
from qnpipe.replay.cost import CostModel
from qnpipe.replay.fast import RunResult
from qnpipe.replay.log import ReplayLog
from qnpipe.replay.predictors import Predictions
from qnpipe.steps import Event, LayerRoute, PartDone, PartGrant, StepDone, Tail


class LogBackend:
    """The forward's `Backend` over recorded routes: begin -> the first MoE layer's route,
    resume -> the modelled compute then the next route, `StepDone` after the last layer."""

    def __init__(self, log: ReplayLog, cost: CostModel, *,
                 predictions: list[list[Predictions]] | None = None) -> None:
        self._log = log
        self._cost = cost
        self._step = -1
        self._i = 0
        self.tokens = 0
        self._predictions = predictions  # [step][i]: what the predictor gets at the step's i-th MoE layer

    def _route(self) -> LayerRoute:
        layer, experts = self._log.steps[self._step][self._i]
        ids = np.asarray(experts, dtype=np.int64).reshape(-1, self._log.shape.top_k)
        preds = self._predictions[self._step][self._i] if self._predictions is not None else ()
        return LayerRoute(layer, ids, preds)

    async def begin(self, inputs: Any, cache: Any, tail: Tail) -> Event:
        self._step += 1
        self._i = 0
        self.tokens += len(self._log.steps[self._step][0][1]) // self._log.shape.top_k
        if self._cost.per_step_s:
            await trio.sleep(self._cost.per_step_s)
        return self._route()

    async def resume(self, grant: PartGrant) -> Event:
        await trio.sleep(self._cost.layer_s(grant.tokens, self._log.steps[self._step][self._i][0],
                                            grant.misses))
        if not grant.last:
            return PartDone()
        self._i += 1
        if self._i == len(self._log.steps[self._step]):
            return StepDone(None)
        return self._route()

    async def abort(self) -> None:
        pass


def run_actors(log: ReplayLog, cfg: Config, caps: dict[int, int], nbytes: dict[int, int], cost: CostModel,
               profile: DeviceProfile, preds: list[list[Predictions]] | None) -> RunResult:
    """Replay `log` on the actors (the arguments as `qnpipe.replay.runner.replay` resolved them); an actor's
    own error (a StallError) is raised as itself, not inside the nurseries' exception groups."""
    async def main() -> RunResult:
        backend = LogBackend(log, cost, predictions=preds)
        t0 = trio.current_time()
        async with open_simssd(profile, nbytes, hop_s=cost.read_hop_s) as dev, \
                open_pipeline(cfg, backend, num_experts=log.shape.num_experts, capacities=caps, device=dev,
                              record_nbytes=nbytes, shape=log.shape, turns=Turnstile()) as p:
            for _ in log.steps:
                await p.forward.run(None, None, lambda h: None)
            elapsed = trio.current_time() - t0
            assert p.policy is not None
            return RunResult(pool=p.policy.statistics(), stall_s=p.forward.stats.stall_s, elapsed_s=elapsed,
                             busy_s=dev.busy_s(), device_reads=dev.stats.reads, device_bytes=dev.stats.bytes_read,
                             tokens=backend.tokens)

    try:
        return trio.run(main, clock=exact_clock())
    except BaseExceptionGroup as group:  # an actor's error (a StallError) comes wrapped in the nurseries' groups
        own: BaseException | None = group.subgroup(lambda x: isinstance(x, QnpipeError))
        if own is None:
            raise
        while isinstance(own, BaseExceptionGroup):
            own = own.exceptions[0]
        raise own from None


__all__ = ["LogBackend", "run_actors"]
