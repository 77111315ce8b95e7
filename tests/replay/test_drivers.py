"""Replay's two drivers agree: the heap driver (qnpipe.replay.fast) and the trio actors under the turnstile.

Random small shapes, routing logs with multi-token steps, and random pool, read, device,
cost and prediction settings give byte-equal reports (or the same error) from both; the
actor driver's report does not depend on the order trio wakes tasks in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio._core._run as trio_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qnpipe import config, trace
from qnpipe.errors import QnpipeError
from qnpipe.io.simssd import DeviceProfile
from qnpipe.replay import CostModel, PredictorOpts, ReplayReport, replay, to_json

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
    return {
        "log": {"seed": draw(st.integers(0, 10_000)), "layers": draw(st.integers(1, 4)), "experts": experts, "k": k,
                "steps": draw(st.integers(3, 10)), "max_tokens": draw(st.integers(1, 4))},
        "set": {"pool.expert_slots": draw(st.integers(k, experts)),
                "pool.evict_policy": draw(st.sampled_from([str(p) for p in config.EvictPolicy])),
                "pool.lrfu_lambda": draw(st.sampled_from([0.05, 0.5])),
                "pool.lfu_decay_interval_forwards": draw(st.sampled_from([0, 2])),
                "read.workers": draw(st.integers(1, 4)), "read.batch_miss_read": draw(st.booleans()),
                "read.bg_budget_experts": draw(st.sampled_from([0, 1, 3])),
                "pool.side_region_slots": side, "pool.side_region_lfu": draw(st.booleans()),
                "pool.prefetch_into": draw(st.sampled_from(["side", "main"])),
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
