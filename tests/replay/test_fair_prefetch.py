"""Prefetch compared fairly: the report's memory, sweep --equal-memory, the placement rule, `previous`'s
first step and the oracle's recall with pool.prefetch_into=main."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.replay import PredictorOpts, describe, load_log, predictions, replay
from qnpipe.replay.model_free import previous_guess
from qnpipe.replay.sweep import parse_grid, plan, run
from qnpipe.replay.synth import SynthSpec, write_synth

NBYTES = 1000


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synth(tmp_path_factory.mktemp("fair") / "s.qtrace",
                       SynthSpec(layers=4, experts=16, top_k=2, tokens=150, seed=1, locality=0.3, cross_layer=0.5))


def _cfg(**over: object) -> config.Config:
    return config.load(None, overrides={"pool.expert_slots": 4, "pool.side_region_slots": 2, **over})


@pytest.mark.parametrize(("predictor", "into", "side"), [("none", "side", 0), ("oracle", "side", 2),
                                                         ("oracle", "main", 2)])
def test_the_report_gives_each_layers_slots_and_the_memory_they_take(log: Path, predictor: str, into: str,
                                                                     side: int) -> None:
    r = replay(log, _cfg(**{"pool.prefetch_into": into}), record_nbytes=NBYTES, predictor=predictor)
    assert (r.side_slots, r.prefetch_into) == (side, into)
    assert r.slots == {layer: 4 + side for layer in r.capacities} and r.capacities == dict.fromkeys(r.capacities, 4)
    assert r.record_nbytes == dict.fromkeys(r.capacities, NBYTES)
    assert r.memory_bytes == len(r.capacities) * (4 + side) * NBYTES
    # a run without prefetch says so (not "prefetch into side"), every run names its eviction policy
    where = f"prefetch into {into}" if predictor != "none" else "prefetch off"
    assert f"slots per layer: 4 resident + {side} side = {4 + side} (lfu eviction, {where}); {NBYTES} B per expert" \
        in describe(r)


@pytest.mark.parametrize("driver", ["fast", "actors"])
def test_prefetch_with_no_side_slot_is_an_error_with_side_placement_and_counts_drops_with_main(
        log: Path, driver: str) -> None:
    with pytest.raises(ConfigError, match="pool.side_region_slots=0 and pool.prefetch_into=side"):
        replay(log, _cfg(**{"pool.side_region_slots": 0}), record_nbytes=NBYTES, predictor="oracle", driver=driver)
    r = replay(log, _cfg(**{"pool.side_region_slots": 0, "pool.prefetch_into": "main",
                            "predict.per_layer_budget_experts": 1}), record_nbytes=NBYTES, predictor="oracle",
               driver=driver)
    assert r.prefetch is not None and r.prefetch.issued > 0 and r.prefetch.dropped > 0
    assert r.side_slots == 0 and r.side_hit_rate > 0  # hits a prefetch into the resident region made


def test_equal_memory_gives_demand_only_points_the_side_regions_slots(log: Path) -> None:
    axes = parse_grid(["replay.predictor=none,oracle", "pool.prefetch_into=side,main"])
    points = plan(log, axes, _cfg(), fixed={"replay.record_nbytes": NBYTES}, equal_memory=True)
    assert [p.cfg.pool.expert_slots for p in points] == [6, 6, 4, 4]
    result = run(log, points, executor="serial")
    assert {p.metrics["slots_per_layer"] for p in result.points} == {6.0}
    assert len({p.metrics["memory_bytes"] for p in result.points}) == 1
    unequal = plan(log, axes, _cfg(), fixed={"replay.record_nbytes": NBYTES})
    assert [p.cfg.pool.expert_slots for p in unequal] == [4, 4, 4, 4]
    with pytest.raises(ConfigError, match=r"grid point replay.predictor=oracle, pool.side_region_slots=0: .*"
                                          "pool.prefetch_into=side"):
        plan(log, parse_grid(["replay.predictor=oracle", "pool.side_region_slots=0"]), _cfg(),
             fixed={"replay.record_nbytes": NBYTES})


def test_equal_memory_refuses_a_capacity_profile(log: Path, tmp_path: Path) -> None:
    prof = tmp_path / "caps.json"
    prof.write_text('{"layer_caps": {"0": 4}}')
    with pytest.raises(ConfigError, match="--equal-memory adds pool.side_region_slots"):
        plan(log, parse_grid(["replay.predictor=none,oracle"]), _cfg(**{"pool.capacity_profile_path": str(prof)}),
             fixed={"replay.record_nbytes": NBYTES}, equal_memory=True)


def test_previous_predicts_the_first_replayed_step_from_the_logs_step_before_it(log: Path) -> None:
    routes = load_log(log)
    k = routes.shape.top_k
    cold = predictions(routes, "previous", PredictorOpts(), width=4, first=0)
    assert all(p == () for p in cold[0])  # no step before the first: nothing to predict from
    assert any(p != () for p in cold[1])
    first = 10
    warm = predictions(routes, "previous", PredictorOpts(train_frac=0.1), width=4, first=first)
    before = dict(routes.steps[first - 1])
    step = routes.steps[first]
    for i, (_, experts) in enumerate(step[:-1]):
        [(target, ids, _)] = warm[0][i]
        assert target == step[i + 1][0]
        assert ids.tolist() == previous_guess(before[target], len(experts) // k, k)[0].tolist()


def test_oracle_hit_rate_rises_with_its_recall_when_prefetches_land_in_the_resident_region(log: Path) -> None:
    for cap, side in ((4, 2), (6, 0)):
        cfg = _cfg(**{"pool.expert_slots": cap, "pool.side_region_slots": side, "pool.prefetch_into": "main"})
        rates = [replay(log, cfg, record_nbytes=NBYTES, predictor="oracle", opts=PredictorOpts(recall=r)).hit_rate
                 for r in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)]
        assert rates == sorted(rates) and rates[-1] > rates[0], (cap, side, rates)
