"""Replay's two drivers agree: the heap driver (qnpipe.replay.fast) and the trio actors under the turnstile.

Random small shapes, routing logs with multi-token steps, and random pool, read, device,
cost and prediction settings give byte-equal reports (or the same error) from both; the
actor driver's report does not depend on the order trio wakes tasks in. Below `replay()`,
the same holds with early grants (a backend that queues the work of the experts in memory)
and pinned experts (autopin's, which lower the forward's capacity), which `replay()` never asks for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
import trio._core._run as trio_run
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qnpipe import config, trace
from qnpipe.actors.pipeline import open_pipeline
from qnpipe.actors.turns import Turnstile, exact_clock
from qnpipe.errors import QnpipeError
from qnpipe.io.simssd import DeviceProfile, open_simssd
from qnpipe.replay import CostModel, PredictorOpts, ReplayReport, replay, to_json
from qnpipe.replay.fast import FastReplay, RunResult
from qnpipe.replay.runner import LogBackend, load_log, predictions, replay_capacities
from qnpipe.steps import Event, PartGrant, Queued
from qnpipe.trace.logs import SyncLogs

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def write_log(path: Path, *, seed: int, layers: int, experts: int, k: int, steps: int, max_tokens: int) -> None:
    rng = np.random.default_rng(seed)
    pop = [rng.permutation(1.0 / np.arange(1, experts + 1) ** 1.2) for _ in range(layers)]
    shape = trace.ModelShape(num_layers=layers, moe_layers=tuple(range(layers)), num_experts=experts, top_k=k,
                             hidden_size=8)
    header = trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="drivers", model=shape,
                          clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes", capacities={})
    w = trace.TraceWriter(path, header)
    seq = 0
    for step in range(1, steps + 1):
        n = int(rng.integers(1, max_tokens + 1))
        for layer in range(layers):
            p = pop[layer] / pop[layer].sum()
            toks = [rng.choice(experts, k, replace=False, p=p) for _ in range(n)]
            seq += 1
            w.write(trace.Route(t=0.0, seq=seq, step=step, layer=layer, top_k=k,
                                experts=tuple(int(e) for t in toks for e in t)))
    w.close(0, 0.0)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    experts = draw(st.integers(4, 16))
    k = draw(st.integers(1, min(4, experts)))
    predictor = draw(st.sampled_from(["none", "previous", "oracle", "transition"]))
    side = draw(st.sampled_from([0, 1, 3]))
    into = draw(st.sampled_from(["side", "main"]))
    steps = draw(st.integers(3, 10))
    # Configurations both drivers refuse are no example of agreement: prefetches with nowhere to land
    # (check_placement), a transition table with no step to learn from.
    assume(predictor == "none" or side > 0 or into == "main")
    assume(predictor != "transition" or int(steps * 0.3) > 0)
    return {
        "log": {"seed": draw(st.integers(0, 10_000)), "layers": draw(st.integers(1, 4)), "experts": experts, "k": k,
                "steps": steps, "max_tokens": draw(st.integers(1, 4))},
        "set": {"pool.expert_slots": draw(st.integers(k, experts)),
                "pool.evict_policy": draw(st.sampled_from([str(p) for p in config.EvictPolicy])),
                "pool.lrfu_lambda": draw(st.sampled_from([0.05, 0.5])),
                "pool.lfu_decay_interval_forwards": draw(st.sampled_from([0, 2])),
                "read.workers": draw(st.integers(1, 4)), "read.batch_miss_read": draw(st.booleans()),
                "read.bg_budget_experts": draw(st.sampled_from([0, 1, 3])),
                "pool.side_region_slots": side, "pool.side_region_lfu": draw(st.booleans()),
                "pool.prefetch_into": into,
                "predict.per_layer_budget_experts": draw(st.integers(0, 4)),
                "predict.file_global_budget_experts": draw(st.sampled_from([0, 2, 8])),
                "read.window_layers": draw(st.sampled_from([0, 1])),
                "diag.route_verify": draw(st.booleans())},
        "device": {"bandwidth_bytes_per_s": draw(st.sampled_from([2e8, 1e9, 6.8e9])),
                   "latency_s": draw(st.sampled_from([0.0, 3.6e-5, 4e-4])),
                   "per_mb_latency_s": draw(st.sampled_from([0.0, 4.9e-5])),
                   "queue_depth": draw(st.integers(1, 8))},
        "cost": {"per_layer_s": draw(st.sampled_from([0.0, 1e-4, 2e-3])),
                 "per_token_s": draw(st.sampled_from([0.0, 3e-5])),
                 "per_step_s": draw(st.sampled_from([0.0, 5e-4])),
                 "read_hop_s": draw(st.sampled_from([0.0, 7e-5])),
                 "per_miss_s": draw(st.sampled_from([0.0, 4e-4]))},
        "predictor": predictor,
        "opts": {"train_frac": 0.3 if predictor == "transition" else 0.0, "recall": 0.7},
    }


def run_case(case: dict[str, object], path: Path, driver: str, event_log: Path | None = None) -> bytes | str:
    """The report's JSON (or the error); with `event_log`, the report followed by that log's bytes."""
    s = case["set"]
    assert isinstance(s, dict)
    over = {key: str(v).lower() if isinstance(v, bool) else str(v) for key, v in s.items()}
    if event_log is not None:
        over["trace.event_log_path"] = str(event_log)
    cfg = config.load(None, overrides=over)
    try:
        r = replay(path, cfg, device_profile=DeviceProfile(**case["device"]),  # type: ignore[arg-type]
                   cost=CostModel(**case["cost"]), record_nbytes=98304,  # type: ignore[arg-type]
                   predictor=str(case["predictor"]), opts=PredictorOpts(**case["opts"]),  # type: ignore[arg-type]
                   driver=driver)
    except QnpipeError as e:
        return f"{type(e).__name__}: {e}"
    if event_log is not None:
        log = event_log.read_bytes()
        event_log.unlink()
        return to_json(r) + b"\n" + log
    return to_json(r)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_fast_driver_gives_the_actor_drivers_report_and_event_log_byte_for_byte(case: dict[str, object]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.qtrace"
        write_log(path, **case["log"])  # type: ignore[arg-type]
        fast = run_case(case, path, "fast", Path(tmp) / "events.qtrace")
        actors = run_case(case, path, "actors", Path(tmp) / "events.qtrace")
    assert fast == actors


def test_an_inline_hit_before_a_read_done_of_the_same_instant_agrees(tmp_path: Path) -> None:
    """Found by the search above: a layer's all-hit acquire at the instant a read of the layer before lands.
    The actor driver's forward answers it in its own action (qnpipe.actors.pool.InlinePool), with the
    layer's last Release held for it, before the read scheduler's turn logs the ReadDone; the heap
    driver must take that turn at the same point, not in the pool's turn after the reads' one."""
    case = {"log": {"seed": 0, "layers": 4, "experts": 9, "k": 1, "steps": 3, "max_tokens": 2},
            "set": {"pool.expert_slots": 3, "pool.evict_policy": "lfu", "pool.lrfu_lambda": 0.05,
                    "pool.lfu_decay_interval_forwards": 0, "read.workers": 2, "read.batch_miss_read": False,
                    "read.bg_budget_experts": 0, "pool.side_region_slots": 0, "pool.side_region_lfu": False,
                    "pool.prefetch_into": "main", "predict.per_layer_budget_experts": 0,
                    "predict.file_global_budget_experts": 0, "read.window_layers": 0, "diag.route_verify": False},
            "device": {"bandwidth_bytes_per_s": 2e8, "latency_s": 0.0, "per_mb_latency_s": 0.0, "queue_depth": 2},
            "cost": {"per_layer_s": 0.0, "per_token_s": 3e-5, "per_step_s": 0.0, "read_hop_s": 0.0,
                     "per_miss_s": 0.0},
            "predictor": "oracle", "opts": {"train_frac": 0.0, "recall": 0.7}}
    write_log(tmp_path / "log.qtrace", **case["log"])  # type: ignore[arg-type]
    fast = run_case(case, tmp_path / "log.qtrace", "fast", tmp_path / "events.qtrace")
    assert isinstance(fast, bytes), fast
    assert fast == run_case(case, tmp_path / "log.qtrace", "actors", tmp_path / "events.qtrace")


@pytest.mark.parametrize("into", ["side", "main"])
def test_a_multi_part_prefetching_case_agrees_and_is_not_trivial(tmp_path: Path, into: str) -> None:
    """One case the random search must not miss: steps split into parts, prefetch, a side region, a slow device,
    prefetches into either region (pool.prefetch_into)."""
    case = {"log": {"seed": 5, "layers": 3, "experts": 12, "k": 3, "steps": 8, "max_tokens": 4},
            "set": {"pool.expert_slots": 4, "pool.side_region_slots": 2, "read.workers": 2,
                    "pool.prefetch_into": into, "diag.route_verify": True},
            "device": {"bandwidth_bytes_per_s": 2e8, "latency_s": 4e-4, "per_mb_latency_s": 0.0, "queue_depth": 2},
            "cost": {"per_layer_s": 1e-4, "read_hop_s": 7e-5}, "predictor": "oracle", "opts": {"recall": 0.8}}
    write_log(tmp_path / "log.qtrace", **case["log"])  # type: ignore[arg-type]
    fast = run_case(case, tmp_path / "log.qtrace", "fast")
    assert isinstance(fast, bytes), fast
    assert fast == run_case(case, tmp_path / "log.qtrace", "actors")
    r = msgspec.json.decode(fast, type=ReplayReport)
    assert r.prefetch is not None and r.prefetch.issued > 0 and r.prefetch.useful > 0 and 0 < r.hit_rate < 1
    assert r.side_hit_rate > 0 and r.prefetch_into == into
    assert r.stall_s_per_token > 0 and r.misses_by_cause


@pytest.mark.parametrize("policy", ["clock", "sieve", "arc", "s3fifo"])
def test_libcachesim_policies_agree_across_drivers(policy: str, tmp_path: Path) -> None:
    """The policies whose pick moves a hand or queues, on multi-token steps with reads in flight and prefetch."""
    case = {"log": {"seed": 11, "layers": 2, "experts": 32, "k": 3, "steps": 10, "max_tokens": 3},
            "set": {"pool.expert_slots": 20 if policy == "s3fifo" else 7, "pool.evict_policy": policy,
                    "pool.side_region_slots": 2, "read.workers": 2},
            "device": {"bandwidth_bytes_per_s": 2e8, "latency_s": 4e-4, "per_mb_latency_s": 0.0, "queue_depth": 2},
            "cost": {"per_layer_s": 1e-4, "read_hop_s": 7e-5}, "predictor": "oracle", "opts": {"recall": 0.8}}
    write_log(tmp_path / "log.qtrace", **case["log"])  # type: ignore[arg-type]
    fast = run_case(case, tmp_path / "log.qtrace", "fast")
    assert isinstance(fast, bytes), fast
    assert fast == run_case(case, tmp_path / "log.qtrace", "actors")
    r = msgspec.json.decode(fast, type=ReplayReport)
    assert 0 < r.hit_rate < 1 and r.misses_by_cause.get("capacity", 0) + r.misses_by_cause.get("not_predicted", 0)


def test_an_unknown_driver_is_refused(tmp_path: Path) -> None:
    write_log(tmp_path / "log.qtrace", seed=1, layers=1, experts=4, k=1, steps=2, max_tokens=1)
    with pytest.raises(QnpipeError, match="driver 'heap': unknown, known: fast, actors"):
        replay(tmp_path / "log.qtrace", config.load(None), record_nbytes=1, driver="heap")


@pytest.mark.parametrize("case", ["skewed-previous-8", "skewed-lfu-12-slow-device"])
def test_the_actor_replay_is_one_report_under_20_trio_scheduling_seeds(case: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """trio shuffles each batch of runnable tasks by `_r` when deterministic scheduling is on: 20 seeds, 20 orders."""
    spec = importlib.util.spec_from_file_location("regen_golden_drivers", TOOLS / "regen_golden.py")
    assert spec is not None and spec.loader is not None
    regen_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen_golden)
    monkeypatch.setattr(trio_run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)
    c = regen_golden.CASES[case]
    cfg = config.load(None, overrides={key: str(v) for key, v in c["set"].items()})
    device = DeviceProfile(**c["device"]) if "device" in c else "apple-m5-internal"
    digests = set()
    for seed in range(20):
        trio_run._r.seed(seed)
        r = replay(regen_golden.GOLDEN / f"{c['log']}.qtrace", cfg, device_profile=device,
                   cost=CostModel(**c.get("cost", {})), record_nbytes=regen_golden.NBYTES,
                   predictor=c.get("predictor", "none"), driver="actors")
        digests.add(hashlib.sha256(to_json(r)).hexdigest())
    fast = replay(regen_golden.GOLDEN / f"{c['log']}.qtrace", cfg, device_profile=device,
                  cost=CostModel(**c.get("cost", {})), record_nbytes=regen_golden.NBYTES,
                  predictor=c.get("predictor", "none"), driver="fast")
    assert digests == {hashlib.sha256(to_json(fast)).hexdigest()}


def test_a_log_rewritten_at_the_same_path_is_read_again(tmp_path: Path) -> None:
    """Replay keeps the last log's routes and guesses for the next replay of it (a sweep's points)."""
    path = tmp_path / "log.qtrace"
    cfg = config.load(None, overrides={"pool.expert_slots": "3"})
    reports = []
    for seed in (1, 2, 1):
        write_log(path, seed=seed, layers=2, experts=8, k=2, steps=6, max_tokens=2)
        reports.append(to_json(replay(path, cfg, record_nbytes=1000, predictor="previous")))
    assert reports[0] != reports[1] and reports[0] == reports[2]


# ---------------------------------------------------------------------------- early grants and pins


class EarlyLogBackend(LogBackend):
    """Replay's backend as one that starts a layer's experts in memory early: the early work is queued
    at no cost (the part's modelled compute runs at its full grant, as the heap driver times it)."""

    early_pairs = 0

    async def resume(self, grant: PartGrant) -> Event:
        if grant.early:
            return Queued()
        return await super().resume(grant)


class FixedPins:
    """Autopin's seam in open_pipeline with a fixed plan: no heat counted, nothing saved."""

    heat = None

    def __init__(self, pins: dict[int, list[int]]) -> None:
        self.pins = pins

    def plan(self, capacities: dict[int, int]) -> dict[int, list[int]]:
        return self.pins

    def after_forward(self) -> None:
        pass

    async def run_saver(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def save_final(self) -> None:
        pass


def run_both(case: dict[str, Any], path: Path, *, early_pairs: int, pins: dict[int, list[int]],
             events: Path) -> tuple[Any, Any]:
    """(fast, actors): each driver's RunResult, its forward's early grants and its event log's bytes, or the error."""
    over = {key: str(v).lower() if isinstance(v, bool) else str(v) for key, v in case["set"].items()}
    over["trace.event_log_path"] = str(events)
    if case["predictor"] != "none":
        over["predict.cross_layer_prefetch"] = "true"
    cfg = config.load(None, overrides=over)
    log = load_log(path)
    first = int(len(log.steps) * case["opts"].get("train_frac", 0.0))
    preds = None if case["predictor"] == "none" else predictions(
        log, case["predictor"], PredictorOpts(**case["opts"]), width=cfg.predict.width_experts, first=first)
    log = msgspec.structs.replace(log, steps=log.steps[first:])
    caps = replay_capacities(cfg, log.shape)
    nbytes = dict.fromkeys(caps, 98304)
    cost, profile = CostModel(**case["cost"]), DeviceProfile(**case["device"])

    def fast() -> Any:
        logs = SyncLogs(cfg, shape=log.shape, capacities=caps)
        try:
            run = FastReplay(log.steps, log.shape.top_k, log.shape.num_experts, cfg, capacities=caps,
                             record_nbytes=nbytes, cost=cost, profile=profile, predictions=preds, emit=logs.emit,
                             pins=pins, early_pairs=early_pairs)
            res = run.run()
        except QnpipeError as e:
            logs.abandon()
            return f"{type(e).__name__}: {e}"
        logs.close(run.reads_drained_t())
        return res, run.core.stats.early_grants

    def actors() -> Any:
        class Backend(EarlyLogBackend):
            pass

        Backend.early_pairs = early_pairs

        async def main() -> tuple[RunResult, int]:
            backend = Backend(log, cost, predictions=preds)
            t0 = trio.current_time()
            async with open_simssd(profile, nbytes, hop_s=cost.read_hop_s) as dev, \
                    open_pipeline(cfg, backend, num_experts=log.shape.num_experts, capacities=caps, device=dev,
                                  record_nbytes=nbytes, shape=log.shape, turns=Turnstile(),
                                  autopin=FixedPins(pins)) as p:  # type: ignore[arg-type]
                for _ in log.steps:
                    await p.forward.run(None, None, lambda h: None)
                assert p.policy is not None
                return RunResult(pool=p.policy.statistics(), stall_s=p.forward.stats.stall_s,
                                 elapsed_s=trio.current_time() - t0, busy_s=dev.busy_s(), device_reads=dev.stats.reads,
                                 device_bytes=dev.stats.bytes_read, tokens=backend.tokens), p.forward.stats.early_grants

        try:
            return trio.run(main, clock=exact_clock())
        except BaseException as e:  # an actor's error comes wrapped in the nurseries' groups
            while isinstance(e, BaseExceptionGroup):
                e = e.exceptions[0]
            if isinstance(e, QnpipeError):
                return f"{type(e).__name__}: {e}"
            raise

    out = []
    for driver in (fast, actors):
        res = driver()
        out.append((res, events.read_bytes()) if not isinstance(res, str) else res)
        events.unlink(missing_ok=True)
    return out[0], out[1]


@st.composite
def pinned_cases(draw: st.DrawFn) -> tuple[dict[str, Any], int, dict[int, list[int]]]:
    case: dict[str, Any] = draw(cases())
    log, slots = case["log"], case["set"]["pool.expert_slots"]
    # Pins leave the forward at least top-k slots: fewer and both drivers refuse every step (CapacityError).
    pins = {layer: draw(st.lists(st.integers(0, log["experts"] - 1), unique=True, max_size=slots - log["k"]))
            for layer in range(log["layers"])}
    return case, draw(st.sampled_from([0, 6, 1000, 1000])), pins


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pinned_cases())
def test_the_drivers_agree_with_early_grants_and_pinned_experts(c: tuple[dict[str, Any], int, dict[int, list[int]]]
                                                                ) -> None:
    case, early_pairs, pins = c
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.qtrace"
        write_log(path, **case["log"])
        fast, actors = run_both(case, path, early_pairs=early_pairs, pins=pins, events=Path(tmp) / "events.qtrace")
    assert fast == actors


def test_early_grants_and_pins_are_reached_and_agree(tmp_path: Path) -> None:
    """One case the random search must not miss: early grants taken while misses are read, pins in every layer."""
    case = {"log": {"seed": 5, "layers": 3, "experts": 12, "k": 2, "steps": 8, "max_tokens": 2},
            "set": {"pool.expert_slots": 6, "pool.side_region_slots": 2, "read.workers": 2,
                    "diag.route_verify": True},
            "device": {"bandwidth_bytes_per_s": 2e8, "latency_s": 4e-4, "per_mb_latency_s": 0.0, "queue_depth": 2},
            "cost": {"per_layer_s": 1e-4, "read_hop_s": 7e-5}, "predictor": "oracle", "opts": {"recall": 0.8}}
    write_log(tmp_path / "log.qtrace", **case["log"])  # type: ignore[arg-type]
    pins = {0: [0, 1], 1: [2], 2: [3, 4, 5]}
    fast, actors = run_both(case, tmp_path / "log.qtrace", early_pairs=1000, pins=pins,
                            events=tmp_path / "events.qtrace")
    assert not isinstance(fast, str), fast
    assert fast == actors
    (res, early), events = fast
    assert early > 0 and b"pool.present" in events
    # the pins' reads went out before the first step, and a step never got a pinned slot's room
    assert res.device_reads >= sum(map(len, pins.values())) and res.pool.hits > 0
    no_pins, _ = run_both(case, tmp_path / "log.qtrace", early_pairs=0, pins={}, events=tmp_path / "events.qtrace")
    assert no_pins[0][1] == 0 and no_pins[0][0] != res
