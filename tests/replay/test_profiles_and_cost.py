"""Device profiles (`qnpipe bench io`, --device measured) and the fitted cost model (`qnpipe trace fit-cost`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgspec
import pytest

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import ConfigError, DeviceProfileError, TraceSchemaError
from qnpipe.io.device_file import MeasuredProfile, ReadSample, load_profile, save_profile
from qnpipe.io.measure import fit_profile, modelled_reads_per_s, run_submitters
from qnpipe.io.simssd import DeviceProfile
from qnpipe.messages import Acquire
from qnpipe.replay import CostModel, replay
from qnpipe.replay.cost_fit import fit_cost, load_cost

GOLDEN = Path(__file__).parent / "golden"
LOG = GOLDEN / "skewed-4x32-top4.qtrace"  # a seeded routing log (tools/regen_golden.py)
NBYTES = 98304


def _cfg(**over: object) -> config.Config:
    return config.load(None, overrides={"pool.expert_slots": "8", **{k: str(v) for k, v in over.items()}})


def test_fit_profile_recovers_the_device_its_samples_came_from() -> None:
    true = DeviceProfile(bandwidth_bytes_per_s=2e9, latency_s=80e-6, per_mb_latency_s=300e-6, queue_depth=4)
    samples = [ReadSample(record_nbytes=n, qd=q, reads_per_s=modelled_reads_per_s(true, n, q),
                          bytes_per_s=modelled_reads_per_s(true, n, q) * n)
               for n in (16384, 98304, 1 << 20) for q in (1, 2, 4, 8, 16)]
    # The best aggregate rate measured is the bandwidth; the slope's rest is per-MB latency.
    got, resid_t, resid_rate = fit_profile(samples)
    assert got.queue_depth == 4 and got.latency_s == pytest.approx(80e-6, rel=1e-6)
    for n in (16384, 98304, 1 << 20):
        assert got.service_s(n) == pytest.approx(true.service_s(n), rel=1e-6)
    assert resid_t == pytest.approx(0, abs=1e-12) and resid_rate == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="2 record sizes"):
        fit_profile([s for s in samples if s.record_nbytes == 16384])


def test_run_submitters_starts_every_thread_together_and_times_the_run() -> None:
    calls = [0, 0, 0]
    made: list[int] = []
    # Each thread's first call waits for the other two: it passes only if all three run at once.
    # (A count of calls in a real-time window is what a loaded machine misses; this is not.)
    together = threading.Barrier(3, timeout=30)

    def make_batch(k: int):  # noqa: ANN202
        made.append(k)

        def one() -> None:
            if calls[k] == 0:
                together.wait()
            calls[k] += 1
        return one

    dt = run_submitters(3, 0.05, make_batch)
    assert sorted(made) == [0, 1, 2]  # every batch maker ran, before the clock started
    assert all(c >= 1 for c in calls) and not together.broken
    assert dt >= 0.05


def test_bench_io_saves_a_profile_that_replay_device_measured_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dev.json"
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-mib", "16", "--seconds", "0.05",
                 "--records", "13824,98304", "--qd", "1,2", "-o", str(out), "-q", "--json"]) == 0
    saved = load_profile(out)
    assert json.loads(capsys.readouterr().out)["profile"] == msgspec.to_builtins(saved.profile)
    assert len(saved.samples) == 4 and all(s.reads_per_s > 0 for s in saved.samples)
    assert list(tmp_path.iterdir()) == [out]  # the test files are gone, no temp file left
    r = replay(LOG, _cfg(**{"read.device_profile_path": out}), device_profile="measured", record_nbytes=NBYTES)
    assert r.device == saved.profile
    assert main(["replay", str(LOG), "--device", "measured", "--set", f"read.device_profile_path={out}",
                 "--set", "replay.record_nbytes=98304", "--set", "device.queue_depth=3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == {**msgspec.to_builtins(saved.profile), "queue_depth": 3}


def test_measured_device_without_a_profile_or_with_a_bad_one_fails_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.json"
    with pytest.raises(DeviceProfileError, match=r"none\.json: .*run `qnpipe bench io` first"):
        replay(LOG, _cfg(**{"read.device_profile_path": missing}), device_profile="measured", record_nbytes=NBYTES)
    assert main(["replay", str(LOG), "--device", "measured", "--set", f"read.device_profile_path={missing}"]) == 2
    assert "run `qnpipe bench io` first" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"profile": {"bandwidth_bytes_per_s": 1e9')
    with pytest.raises(DeviceProfileError, match=r"bad\.json: not a device profile"):
        load_profile(bad)
    good = MeasuredProfile(profile=DeviceProfile(bandwidth_bytes_per_s=1e9, latency_s=1e-4), latency_fit_residual_s=0,
                           rate_fit_residual=0, backend="c", mode="o_direct", samples=[])
    save_profile(bad, msgspec.structs.replace(good, profile=msgspec.structs.replace(good.profile, queue_depth=0)))
    with pytest.raises(DeviceProfileError, match=r"bad\.json: profile\.queue_depth=0: must be >= 1"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="device profile 'ssd9': unknown, known: apple-m5-internal, measured"):
        replay(LOG, _cfg(), device_profile="ssd9", record_nbytes=NBYTES)


@pytest.fixture(scope="module")
def replayed_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CostModel]:
    """An event log written by a replay, so its compute gaps are exactly a known cost model."""
    path = tmp_path_factory.mktemp("fit") / "replayed.qtrace"
    cost = CostModel(per_layer_s=1.5e-3, per_token_s=2e-4, per_step_s=8e-4)
    replay(LOG, _cfg(**{"trace.event_log_path": path}), cost=cost, record_nbytes=NBYTES)
    return path, cost


def test_fit_cost_recovers_the_cost_model_a_log_was_made_with(replayed_log: tuple[Path, CostModel]) -> None:
    path, cost = replayed_log
    fit = fit_cost(path)
    assert fit.fitted == ["per_layer_s", "per_token_s", "per_step_s"]
    assert fit.cost.per_layer_s == pytest.approx(cost.per_layer_s, rel=1e-6)
    assert fit.cost.per_token_s == pytest.approx(cost.per_token_s, rel=1e-6)
    assert fit.cost.per_step_s == pytest.approx(cost.per_step_s, rel=1e-6)
    acquires = sum(isinstance(r, Acquire) for r in trace.read(path)[1])
    assert acquires > 4 * 40  # the 6-token first step's layers are split into parts
    assert fit.rms_residual_s < 1e-9 and fit.steps == 40 and fit.samples == acquires - 1
    # Against the device it was replayed on, the miss path has no time beyond the device.
    with_dev = fit_cost(path, DeviceProfile(bandwidth_bytes_per_s=6.8e9, latency_s=36e-6, per_mb_latency_s=49e-6,
                                            queue_depth=8))
    assert with_dev.cost.read_hop_s == pytest.approx(0, abs=1e-9)
    # ... and against a faster one, the difference shows as read_hop_s.
    fast = fit_cost(path, DeviceProfile(bandwidth_bytes_per_s=1e12, latency_s=0.0, queue_depth=8))
    assert fast.cost.read_hop_s > 0 and "read_hop_s" in fast.fitted


def test_fit_cost_cli_writes_the_cost_file_replay_cost_reads(replayed_log: tuple[Path, CostModel], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path, cost = replayed_log
    out = tmp_path / "cost.json"
    assert main(["trace", "fit-cost", str(path), "-o", str(out)]) == 0
    assert "per_layer_s=0.0015" in capsys.readouterr().out
    assert load_cost(out).cost.per_step_s == pytest.approx(cost.per_step_s, rel=1e-6)
    assert main(["replay", str(path), "--cost", str(out), "--set", "pool.expert_slots=8", "--json",
                 "--set", "cost.per_token_s=0"]) == 0
    got = json.loads(capsys.readouterr().out)["cost"]
    assert got["per_token_s"] == 0 and got["per_layer_s"] == pytest.approx(cost.per_layer_s, rel=1e-6)
    out.write_text("{}")
    with pytest.raises(ConfigError, match=r"cost\.json: not a cost file"):
        load_cost(out)
    assert main(["replay", str(path), "--cost", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: not found: a cost file is written by `qnpipe trace fit-cost" in capsys.readouterr().err


def test_fit_cost_of_a_routing_log_says_it_needs_an_event_log() -> None:
    with pytest.raises(TraceSchemaError, match=r"0 pool.acquire record\(s\): a cost fit needs a streamed run's event log"):
        fit_cost(LOG)


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "io"], "fit a device profile"), (["bench"], "Benchmarks of this machine"),
    (["trace", "fit-cost"], "Fit per_layer_s, per_token_s and per_step_s"),
    (["replay"], "qnpipe replay run.qtrace --cost run.cost.json --device measured")])
def test_help_of_the_new_commands_teaches(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: qnpipe {' '.join(argv)}" in out and says in out and "examples:" in out


def test_bench_io_and_fit_cost_refuse_bad_arguments_naming_them(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "io", "--records", "13824,x", "--dir", str(tmp_path)]) == 2
    assert "--records '13824,x': expected comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "io", "--qd", "2,4", "--dir", str(tmp_path)]) == 2
    assert "qd 1" in capsys.readouterr().err
    assert main(["bench", "io", "--dir", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["trace", "fit-cost", str(LOG), "-o", str(tmp_path / "c.json"), "--device", "measured",
                 "--set", f"read.device_profile_path={tmp_path / 'none.json'}"]) == 2
    assert "run `qnpipe bench io` first" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_fit_cost_leaves_out_a_pause_between_generate_calls(replayed_log: tuple[Path, CostModel],
                                                             tmp_path: Path) -> None:
    path, cost = replayed_log
    header, records = trace.read(path)
    paused = tmp_path / "paused.qtrace"
    w = trace.TraceWriter(paused, header)
    for r in records:  # the caller idles 5 s before step 21, as between two generate calls
        w.write(msgspec.structs.replace(r, t=r.t + 5.0) if getattr(r, "step", 0) >= 21 else r)
    w.close(0, 0.0)
    fit = fit_cost(paused)
    assert fit.pauses == 1 and fit.samples == fit_cost(path).samples - 1
    assert fit.cost.per_step_s == pytest.approx(cost.per_step_s, rel=1e-6)
    assert fit.cost.per_layer_s == pytest.approx(cost.per_layer_s, rel=1e-6)


def test_fit_cost_per_layer_recovers_each_layer_s_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = {0: 1e-3, 1: 2e-3, 2: 1.5e-3, 3: 3e-3}
    cost = CostModel(per_layer_s=9.0, per_token_s=2e-4, per_step_s=8e-4, layer_table=table)
    path = tmp_path / "layers.qtrace"
    replay(LOG, _cfg(**{"trace.event_log_path": path}), cost=cost, record_nbytes=NBYTES)
    fit = fit_cost(path, per_layer=True)
    # The 6-token first step splits layer 3 into parts, so the step term is told apart from layer 3's.
    assert fit.fitted == ["layer_table", "per_token_s", "per_step_s"] and fit.rms_residual_s < 1e-9
    assert fit.cost.layer_table == pytest.approx(table, rel=1e-6)
    assert fit.cost.per_step_s == pytest.approx(8e-4, rel=1e-6)
    assert min(table.values()) < fit.cost.per_layer_s < max(table.values())
    # A replay with the fitted table takes the live (here: the first replay's) time.
    assert replay(LOG, _cfg(), cost=fit.cost, record_nbytes=NBYTES).virtual_s == pytest.approx(
        replay(LOG, _cfg(), cost=cost, record_nbytes=NBYTES).virtual_s, rel=1e-9)
    out = tmp_path / "c.json"
    assert main(["trace", "fit-cost", str(path), "-o", str(out), "--per-layer"]) == 0
    assert "per layer: 0: 1.000 ms, 1: 2.000 ms, 2: 1.500 ms, 3: 3.000 ms" in capsys.readouterr().out
    assert load_cost(out).cost.layer_table == pytest.approx(table, rel=1e-6)


def test_fit_cost_of_two_logs_recovers_the_compute_a_miss_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = CostModel(per_layer_s=1.5e-3, per_token_s=2e-4, per_step_s=8e-4, per_miss_s=4e-4)
    paths = []
    for slots in (6, 12):  # two hit rates: the misses' term apart from the intercept across runs too
        paths.append(tmp_path / f"s{slots}.qtrace")
        replay(LOG, _cfg(**{"trace.event_log_path": paths[-1], "pool.expert_slots": slots}), cost=cost,
               record_nbytes=NBYTES)
    fit = fit_cost(paths, per_miss=True)
    assert fit.fitted == ["per_layer_s", "per_token_s", "per_step_s", "per_miss_s"] and fit.rms_residual_s < 1e-9
    for term in ("per_layer_s", "per_token_s", "per_step_s", "per_miss_s"):
        assert getattr(fit.cost, term) == pytest.approx(getattr(cost, term), rel=1e-6), term
    assert fit.samples == sum(fit_cost(p).samples for p in paths) and fit.steps == 80
    # Without the term, the intercept takes the misses' mean share, so the fit predicts the same
    # time at the hit rate it saw less well at another one.
    plain = fit_cost(paths[0])
    assert plain.cost.per_miss_s == 0.0 and plain.cost.per_layer_s > cost.per_layer_s * 1.1
    at = _cfg(**{"pool.expert_slots": 12})
    true_s = replay(LOG, at, cost=cost, record_nbytes=NBYTES).virtual_s
    assert replay(LOG, at, cost=fit.cost, record_nbytes=NBYTES).virtual_s == pytest.approx(true_s, rel=1e-9)
    assert abs(replay(LOG, at, cost=plain.cost, record_nbytes=NBYTES).virtual_s - true_s) > 0.01 * true_s
    out = tmp_path / "c.json"
    assert main(["trace", "fit-cost", *map(str, paths), "-o", str(out), "--per-miss"]) == 0
    assert "per_miss_s=0.0004 " in capsys.readouterr().out
    assert load_cost(out).cost.per_miss_s == pytest.approx(4e-4, rel=1e-6)
