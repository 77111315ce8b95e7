"""Replay: a log from `qnpipe generate --trace` through the real pool on a SimSSD, in virtual time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import ConfigError, TraceSchemaError
from qnpipe.io.simssd import DeviceProfile, open_simssd
from qnpipe.policy.read_queue import Job
from qnpipe.replay import CostModel, replay, to_json
from qnpipe.replay.belady import belady_hits, brute_force_hits
from tests.profiles import examples

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}
SLOTS = "4"


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """A streamed tiny model's event log, and the live run's --json output."""
    import contextlib
    import io

    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("replay")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE)
    convert(hf, root / "q")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", str(root / "q"), "--tokens", "5,6,7,8,9", "-n", "6", "--json",
                     "--set", f"pool.expert_slots={SLOTS}", "--trace", str(root / "run.qtrace")]) == 0
    return root / "run.qtrace", json.loads(out.getvalue())


def _cfg(**over: str) -> config.Config:
    return config.load(None, overrides={"pool.expert_slots": SLOTS, **over})


def test_replay_of_a_generated_log_matches_the_live_pool(logged: tuple[Path, dict[str, object]]) -> None:
    path, live = logged
    r = replay(path, _cfg())
    pool = live["engine"]["pool"]  # type: ignore[index]
    assert r.steps == pool["steps"] and r.tokens == 10  # 5 prompt tokens + 5 decoded
    # demand caching on the same routes and policy: the same hits and misses as the live run
    assert sum(x.hits for x in r.layers) == pool["hits"]
    assert r.misses_by_cause == pool["misses_by_cause"]
    assert [x.hits for x in r.layers] == [x["hits"] for x in pool["layers"]]
    assert r.reads == pool["reads"] and r.bytes_per_token * r.steps == pool["bytes_read"]
    assert r.virtual_s > 0 and r.tok_s == r.steps / r.virtual_s and 0 < r.device_utilisation < 1


def test_same_log_and_config_give_byte_identical_reports(logged: tuple[Path, dict[str, object]]) -> None:
    path, _ = logged
    cfg = _cfg(**{"read.workers": "3"})
    slow = DeviceProfile(bandwidth_bytes_per_s=1e8, latency_s=1e-4, per_mb_latency_s=1e-4, queue_depth=2)
    runs = {to_json(replay(path, cfg, device_profile=slow, cost=CostModel(per_layer_s=1e-4))) for _ in range(3)}
    assert len(runs) == 1
    cmd = [sys.executable, "-m", "qnpipe", "replay", str(path), "--json", "--set", f"pool.expert_slots={SLOTS}",
           "--set", "device.queue_depth=2", "--set", "cost.per_layer_s=0.0001"]
    outs = {subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1
    assert json.loads(outs.pop())["device"]["queue_depth"] == 2


@pytest.mark.parametrize("policy", ["lfu", "lru", "fifo", "lrfu", "clock", "sieve", "arc", "s3fifo"])
@pytest.mark.parametrize("slots", ["2", "5"])
def test_belady_bounds_every_demand_policy_per_layer(logged: tuple[Path, dict[str, object]], policy: str,
                                                      slots: str) -> None:
    path, _ = logged
    r = replay(path, _cfg(**{"pool.evict_policy": policy, "pool.expert_slots": slots}))
    for x in r.layers:
        assert x.requests and x.belady_hit_rate >= x.hit_rate, x


def test_truncated_log_fails_naming_the_record(logged: tuple[Path, dict[str, object]], tmp_path: Path) -> None:
    path, _ = logged
    bad = tmp_path / "cut.qtrace"
    bad.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(TraceSchemaError, match=r"record \d+"):
        replay(bad, _cfg())
    assert main(["replay", str(bad)]) == 2


def test_a_route_that_does_not_fit_the_header_fails_naming_the_record(tmp_path: Path) -> None:
    shape = trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, hidden_size=4)
    path = tmp_path / "bad.qtrace"
    w = trace.TraceWriter(path, trace.Header(schema_version=1, fingerprint="x", model=shape, clock_start_t=0.0,
                                              wall_start_unix_s=0.0, contents="routes", capacities={0: 4, 1: 4}))
    w.write(trace.Route(t=0.0, seq=0, step=1, layer=0, top_k=2, experts=(1, 2)))
    w.write(trace.Route(t=0.0, seq=1, step=1, layer=1, top_k=2, experts=(1, 9)))
    w.close(0, 0.0)
    with pytest.raises(TraceSchemaError, match=r"record 2 \(trace.route step 1\): an expert id outside 0..7"):
        replay(path, _cfg(), record_nbytes=10)


def test_a_routing_log_replays_given_the_record_size(logged: tuple[Path, dict[str, object]], tmp_path: Path) -> None:
    path, _ = logged
    routes = tmp_path / "routes.qtrace"
    header, records = trace.read(path)
    w = trace.TraceWriter(routes, msgspec.structs.replace(header, contents="routes"))
    for r in records:
        if isinstance(r, trace.Route):
            w.write(r)
    w.close(0, 0.0)
    with pytest.raises(ConfigError, match="record_nbytes"):
        replay(routes, _cfg())
    full = replay(path, _cfg())
    nbytes = int(full.bytes_per_token * full.steps) // full.reads
    again = replay(routes, _cfg(), record_nbytes=nbytes)
    assert to_json(msgspec.structs.replace(again, log="")) == to_json(msgspec.structs.replace(full, log=""))


def test_a_log_of_another_model_shape_fails_before_replay(logged: tuple[Path, dict[str, object]],
                                                           tmp_path: Path) -> None:
    path, _ = logged
    profile = tmp_path / "caps.json"
    profile.write_text(json.dumps({"layer_caps": {"0": 4, "7": 4}}))  # layer 7: a deeper model's
    with pytest.raises(ConfigError, match=r"layers \[7\] are not MoE layers"):
        replay(path, _cfg(**{"pool.capacity_profile_path": str(profile)}))
    with pytest.raises(ConfigError, match="below the model's top-k"):
        replay(path, _cfg(**{"pool.expert_slots": "1"}))


def test_simssd_serves_queue_depth_at_once_and_completes_in_a_fixed_order() -> None:
    prof = DeviceProfile(bandwidth_bytes_per_s=1e6, latency_s=0.5, per_mb_latency_s=0.25, queue_depth=2)

    async def main_() -> list[tuple[float, int]]:
        done: list[tuple[float, int]] = []
        async with open_simssd(prof, {0: 1_000_000, 1: 2_000_000}) as dev, trio.open_nursery() as n:
            async def one(i: int, layer: int) -> None:
                assert await dev.read([Job(layer, i, i)]) == [(layer + 1) * 1_000_000]
                done.append((trio.current_time(), i))
            for i in range(5):
                n.start_soon(one, i, 1 if i == 1 else 0)
                await trio.lowlevel.checkpoint()  # submitted in order 0..4
        return done

    runs = {tuple(trio.run(main_, clock=trio.testing.MockClock(autojump_threshold=0))) for _ in range(20)}
    assert len(runs) == 1
    # 1 MB = 0.5 + 0.25 + 1 s; 2 MB = 0.5 + 0.5 + 2 s; two in service, the rest FIFO
    assert runs.pop() == ((1.75, 0), (3.0, 1), (3.5, 2), (4.75, 3), (5.25, 4))


def test_simssd_same_finish_times_complete_in_submission_order_and_busy_time_is_exact() -> None:
    prof = DeviceProfile(bandwidth_bytes_per_s=1e6, latency_s=0.0, queue_depth=8)

    async def main_() -> tuple[list[int], float, int]:
        order: list[int] = []
        async with open_simssd(prof, {0: 1_000_000}) as dev, trio.open_nursery() as n:
            async def one(i: int) -> None:
                await dev.read([Job(0, i, i), Job(0, i + 100, i + 100)])  # a batch of two
                order.append(i)
            for i in range(6):
                n.start_soon(one, i)
                await trio.lowlevel.checkpoint()
        assert trio.current_time() == 2.0  # 12 reads of 1 s, 8 at once: 8 end at 1 s, 4 at 2 s
        return order, dev.stats.busy_s, dev.stats.peak_in_service

    runs = {repr(trio.run(main_, clock=trio.testing.MockClock(autojump_threshold=0))) for _ in range(30)}
    assert runs == {repr(([0, 1, 2, 3, 4, 5], 2.0, 8))}


# more: cheap (tiny caches), and Belady's tie-breaks need many cases
@examples(200)
@given(cap=st.integers(2, 3), reqs=st.lists(st.sets(st.integers(0, 5), min_size=1, max_size=2), max_size=9))
def test_belady_equals_the_brute_force_optimum(cap: int, reqs: list[set[int]]) -> None:
    seq = [sorted(r) for r in reqs]
    assert belady_hits(seq, cap) == brute_force_hits(seq, cap)


def test_previous_token_predictor_replays_deterministically(logged: tuple[Path, dict[str, object]]) -> None:
    path, _ = logged
    cfg = _cfg(**{"pool.side_region_slots": "2"})
    a, b = (replay(path, cfg, predictor="previous") for _ in range(2))
    assert to_json(a) == to_json(b) and a.predictor == "previous"
    demand = replay(path, cfg)
    total = sum(x.requests - x.hits for x in a.layers)
    assert sum(a.misses_by_cause.values()) == total and "capacity" not in a.misses_by_cause  # predicting causes
    assert "capacity" in demand.misses_by_cause
    with pytest.raises(ConfigError, match="predictor 'clairvoyant'"):
        replay(path, cfg, predictor="clairvoyant")


def test_replay_help_teaches_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["replay", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: qnpipe replay" in out and "examples:" in out and "qnpipe replay run.qtrace" in out


def test_cli_replay_json_and_bad_settings(logged: tuple[Path, dict[str, object]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = logged
    assert main(["replay", str(path), "--json", "--set", f"pool.expert_slots={SLOTS}"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["device"]["bandwidth_bytes_per_s"] == 6.8e9 and len(rep["layers"]) == 3
    assert main(["replay", str(path), "--set", "device.queue_depth=0"]) == 2
    assert "queue_depth=0" in capsys.readouterr().err
    assert main(["replay", str(path), "--device", "floppy"]) == 2
    assert "apple-m5-internal" in capsys.readouterr().err
