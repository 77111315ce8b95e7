"""Sweeps: a grid of replays through local processes and a Dask LocalCluster, checked up front, tabled and plotted."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import ConfigError
from qnpipe.replay import replay, sweep, to_json

NBYTES = 1 << 20
GRID = ["pool.expert_slots=4,8", "evict_policy=lru,lfu"]  # a short name, resolved to pool.evict_policy
POINTS = [(4, "lru"), (4, "lfu"), (8, "lru"), (8, "lfu")]  # grid order: the last field varies fastest


def write_routes(path: Path, steps: int = 30, seed: int = 1) -> Path:
    """A routing log of a 4-layer, 16-expert, top-2 model with skewed, drifting routes."""
    shape = trace.ModelShape(num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=16, top_k=2, hidden_size=8)
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=shape,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes"))
    rng = random.Random(seed)
    seq = 0
    for step in range(1, steps + 1):
        for layer in shape.moe_layers:
            hot = list(range(step % 4, step % 4 + 6))
            ex = rng.sample(hot, 2) if rng.random() < 0.7 else rng.sample(range(16), 2)
            w.write(trace.Route(t=0.0, seq=seq, step=step, layer=layer, top_k=2, experts=tuple(ex)))
            seq += 1
    w.close(0, 0.0)
    return path


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_routes(tmp_path_factory.mktemp("sweep") / "routes.qtrace")


def _points(log: Path) -> list[sweep.Point]:
    return sweep.plan(log, sweep.parse_grid(GRID), config.load(None, env={}),
                      fixed={"replay.record_nbytes": str(NBYTES)})


CLI = ["--grid", *GRID, "--set", f"replay.record_nbytes={NBYTES}", "--no-progress"]


@pytest.fixture(scope="module")
def processes_json(log: Path) -> bytes:
    """The sweep's JSON file from `qnpipe sweep` through two local worker processes (the default executor)."""
    out = log.with_name("processes.json")
    assert main(["sweep", str(log), *CLI, "--jobs", "2", "-o", str(out)]) == 0
    assert not list(log.parent.glob(".*.tmp"))  # written through a temporary name (qnpipe.io.atomic), none left
    return out.read_bytes()


@pytest.fixture(scope="module")
def by_processes(processes_json: bytes) -> sweep.SweepResult:
    return msgspec.json.decode(processes_json, type=sweep.SweepResult)


def test_points_through_processes_equal_the_serial_replay_of_each_point(log: Path,
                                                                          by_processes: sweep.SweepResult) -> None:
    assert [(p.values["pool.expert_slots"], p.values["pool.evict_policy"]) for p in by_processes.points] == POINTS
    assert by_processes.fields == ["pool.expert_slots", "pool.evict_policy"]
    for p, (slots, policy) in zip(by_processes.points, POINTS, strict=True):
        cfg = config.load(None, env={}, overrides={"pool.expert_slots": slots, "pool.evict_policy": policy})
        alone = replay(log, cfg, record_nbytes=NBYTES)
        assert p.report is not None and to_json(p.report) == to_json(alone)
        assert p.metrics["tok_s"] == alone.tok_s and p.metrics["hit_rate"] == alone.hit_rate
    # the grid matters: more slots, more hits (so equal reports above are not all the same report)
    rates = [p.metrics["hit_rate"] for p in by_processes.points]
    assert rates[2] > rates[0] and rates[3] > rates[1]


def _cluster(threads: int) -> Any:
    """A Dask cluster in this process (threads, no dashboard): the scheduler and client are real, start-up is fast."""
    from dask.distributed import LocalCluster

    return LocalCluster(processes=False, n_workers=1, threads_per_worker=threads, dashboard_address=cast(Any, None))


def test_a_dask_local_cluster_gives_the_same_json_as_local_processes(log: Path,
                                                                      by_processes: sweep.SweepResult) -> None:
    from dask.distributed import Client

    with _cluster(threads=2) as cluster:
        by_address = sweep.run(log, _points(log), executor="dask", scheduler=cluster.scheduler_address)
        with Client(cluster) as client:
            by_client = sweep.run(log, _points(log), executor="dask", scheduler=client)
    assert sweep.to_json(by_address) == sweep.to_json(by_processes) == sweep.to_json(by_client)
    assert sweep.to_json(by_address) == sweep.to_json(sweep.run(log, _points(log), executor="serial"))


def test_the_cli_writes_identical_json_through_processes_and_dask(log: Path, tmp_path: Path,
                                                                 processes_json: bytes) -> None:
    assert processes_json == sweep.to_json(msgspec.json.decode(processes_json, type=sweep.SweepResult)) + b"\n"
    with _cluster(threads=1) as cluster:
        assert main(["sweep", str(log), *CLI, "--executor", "dask", "--scheduler", cluster.scheduler_address,
                     "-o", str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d.json").read_bytes() == processes_json
    got = msgspec.json.decode(processes_json)
    assert [list(p["values"].values()) for p in got["points"]] == [list(x) for x in POINTS]


@pytest.mark.parametrize(("item", "named"), [
    ("pool.expert_slotz=4,8", "pool.expert_slotz"),
    ("expert_slotz=4,8", "expert_slotz"),
    ("pool.expert_slots=4,lots", "lots"),
    ("pool.expert_slots=8,1", "pool.expert_slots=1"),  # below the model's top-k
    ("pool.evict_policy=lru,mru", "mru"),
    ("device.queue_depth=0,2", "queue_depth=0"),
    ("replay.predictor=none,psychic", "psychic"),
    ("pool.expert_slots=4,,8", "empty value"),
])
def test_a_bad_grid_fails_before_any_replay_naming_it(log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], item: str,
                                                      named: str) -> None:
    ran: list[object] = []
    monkeypatch.setattr(sweep, "replay", lambda *a, **k: ran.append(a))
    out = tmp_path / "s.json"
    assert main(["sweep", str(log), "--grid", item, "--executor", "serial", "-o", str(out),
                 "--set", f"replay.record_nbytes={NBYTES}"]) == 2
    assert named in capsys.readouterr().err
    assert not ran and not out.exists()


def test_points_may_write_event_logs_only_to_files_of_their_own(log: Path, tmp_path: Path) -> None:
    base = config.load(None, env={}, overrides={"trace.event_log_path": str(tmp_path / "one.qtrace")})
    with pytest.raises(ConfigError, match=r"grid point pool.expert_slots=8: writes the log .*one.qtrace that grid point 0"):
        sweep.plan(log, sweep.parse_grid(["pool.expert_slots=4,8"]), base, fixed={"replay.record_nbytes": NBYTES})
    each = sweep.parse_grid([f"trace.event_log_path={tmp_path / 'a.qtrace'},{tmp_path / 'b.qtrace'}"])
    sweep.run(log, sweep.plan(log, each, config.load(None, env={}), fixed={"replay.record_nbytes": NBYTES}),
              executor="serial")
    assert (tmp_path / "a.qtrace").is_file() and (tmp_path / "b.qtrace").is_file()


def test_a_routing_log_without_the_record_size_fails_before_any_replay(log: Path) -> None:
    with pytest.raises(ConfigError, match=r"grid point pool.expert_slots=4: .*replay.record_nbytes"):
        sweep.plan(log, sweep.parse_grid(["pool.expert_slots=4"]), config.load(None, env={}))


def test_unknown_metric_and_dask_without_scheduler_fail_at_once(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(log), "--grid", "pool.expert_slots=4", "--metric", "speed"]) == 2
    assert "--metric 'speed': unknown, known: " in capsys.readouterr().err
    assert main(["sweep", str(log), "--grid", "pool.expert_slots=4", "--executor", "dask"]) == 2
    assert "--scheduler" in capsys.readouterr().err
    assert main(["sweep", str(log), "--grid", "pool.expert_slots=4", "-o", str(log.parent / "no" / "s.json")]) == 2
    assert "s.json: cannot write the sweep JSON (-o)" in capsys.readouterr().err


def test_short_names_resolve_and_values_split_on_semicolons(tmp_path: Path) -> None:
    axes = sweep.parse_grid(["expert_slots=4,8", "queue_depth=1;2", "per_layer_s=0.001"])
    assert [(a.field, a.values) for a in axes] == [("pool.expert_slots", ("4", "8")),
                                                   ("device.queue_depth", ("1", "2")),
                                                   ("cost.per_layer_s", ("0.001",))]
    assert sweep.parse_grid(["diag.union_prof=true"])[0].field == "diag.union_prof"
    assert sweep.parse_grid(["EXPERT_SLOTS=4"])[0].field == "pool.expert_slots"  # a legacy name, as config reads it
    with pytest.raises(ConfigError, match="legacy switch RESIDENT_POOL has no effect"):
        sweep.parse_grid(["RESIDENT_POOL=1,0"])
    layers = sweep.parse_grid(["trace.route_trace_layers=0-1;2,3"])
    assert layers[0].values == ("0-1", "2,3")
    points = sweep.plan(write_routes(tmp_path / "r.qtrace"), layers, config.load(None, env={}),
                        fixed={"replay.record_nbytes": NBYTES})
    assert [p.values["trace.route_trace_layers"] for p in points] == [(0, 1), (2, 3)]
    with pytest.raises(ConfigError, match="already swept"):
        sweep.parse_grid(["expert_slots=4", "pool.expert_slots=8"])


def _is_png(path: Path) -> tuple[int, int]:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    with Image.open(path) as im:
        im.verify()
    return width, height


def test_plots_are_written_and_the_table_printed(log: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    plots = tmp_path / "plots"
    assert main(["sweep", str(log), "--grid", *GRID, "--set", f"replay.record_nbytes={NBYTES}", "--executor",
                 "serial", "--metric", "hit_rate", "--plot-dir", str(plots)]) == 0
    out = capsys.readouterr().out
    assert "sweep of" in out and "pool.expert_slots" in out and "pool.evict_policy" in out and "hit_rate" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 4 and all(policy in row for row, (_, policy) in zip(rows, POINTS, strict=True))
    files = sorted(p.name for p in plots.iterdir())
    assert files == ["hit_rate-vs-pool.evict_policy.png", "hit_rate-vs-pool.expert_slots.png"]
    for f in files:
        w, h = _is_png(plots / f)
        assert w > 300 and h > 200


def test_series_give_one_line_per_value_of_the_other_fields(by_processes: sweep.SweepResult) -> None:
    from qnpipe.replay.sweep_plot import series

    xs, lines = series(by_processes, "pool.expert_slots", "hit_rate")
    assert xs == [4, 8]
    assert list(lines) == ["eviction policy = lru", "eviction policy = lfu"]  # labelled by LABELS, not the key
    assert [y for _, y in lines["eviction policy = lfu"]] == [by_processes.points[i].metrics["hit_rate"]
                                                              for i in (1, 3)]


def test_help_teaches_the_grid_and_the_executors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: qnpipe sweep" in out and "examples:" in out and "--executor dask --scheduler" in out
    assert "cartesian product" in out


def test_results_come_in_grid_order_when_points_finish_out_of_order(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    real = sweep.replay
    last_done = threading.Event()
    finished: list[tuple[int, str]] = []

    def replay_slowly(path: object, cfg: config.Config, **kw: object) -> object:
        key = (cfg.pool.expert_slots, str(cfg.pool.evict_policy))
        if key == POINTS[0]:  # the first point waits for the last one (two worker threads)
            assert last_done.wait(20)
        r = real(path, cfg, **kw)  # type: ignore[arg-type]
        finished.append(key)
        if key == POINTS[-1]:
            last_done.set()
        return r

    monkeypatch.setattr(sweep, "replay", replay_slowly)
    with _cluster(threads=2) as cluster:
        result = sweep.run(log, _points(log), executor="dask", scheduler=cluster.scheduler_address)
    assert finished[-1] == POINTS[0] and finished != POINTS
    assert [(p.values["pool.expert_slots"], p.values["pool.evict_policy"]) for p in result.points] == POINTS
    assert [p.index for p in result.points] == [0, 1, 2, 3]


@pytest.mark.parametrize("executor", ["serial", "dask"])
@pytest.mark.parametrize("error", ["schema", "read", "bug"])
def test_a_point_that_fails_in_its_replay_is_named_and_the_others_complete(
        log: Path, monkeypatch: pytest.MonkeyPatch, executor: str, error: str) -> None:
    from qnpipe.errors import ReadError, TraceSchemaError

    real = sweep.replay

    def fail_at_8(path: object, cfg: config.Config, **kw: object) -> object:
        if cfg.pool.expert_slots == 8 and cfg.pool.evict_policy == "lru":
            if error == "schema":
                raise TraceSchemaError("device on fire")
            if error == "read":  # an error whose constructor takes more than the message: still reported
                raise ReadError("device on fire", layer=0, expert=1, path="x", offset=0, nbytes=1)
            raise KeyError("device on fire")
        return real(path, cfg, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sweep, "replay", fail_at_8)
    if executor == "serial":
        result = sweep.run(log, _points(log), executor="serial")
    else:
        with _cluster(threads=1) as cluster:
            result = sweep.run(log, _points(log), executor="dask", scheduler=cluster.scheduler_address)
    assert result.failed == [2]
    bad = result.points[2]
    assert bad.report is None and bad.metrics == {} and bad.error is not None
    assert bad.error.startswith("grid point 2 (pool.expert_slots=8, pool.evict_policy=lru): ")
    assert "device on fire" in bad.error and ("KeyError" in bad.error) == (error == "bug")
    assert all(p.report is not None and p.error is None for i, p in enumerate(result.points) if i != 2)


def test_the_log_may_follow_the_grid(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--grid", "pool.expert_slots=4,8", str(log), "--executor", "serial", "--set",
                 f"replay.record_nbytes={NBYTES}", "--json"]) == 0
    assert [p["values"] for p in msgspec.json.decode(capsys.readouterr().out)["points"]] == [
        {"pool.expert_slots": 4}, {"pool.expert_slots": 8}]
    assert main(["sweep", "--grid", "pool.expert_slots=4,8"]) == 2
    assert "give the LOG" in capsys.readouterr().err


def test_progress_counts_every_point_and_json_prints_the_file(log: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[int, int]] = []
    sweep.run(log, _points(log), executor="serial", progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    out = tmp_path / "s.json"
    assert main(["sweep", str(log), *CLI, "--executor", "serial", "--json", "-o", str(out)]) == 0
    assert capsys.readouterr().out.encode() == out.read_bytes()


def test_a_terminated_pool_leaves_no_thread_to_write_to_its_closed_pipes(capfd: pytest.CaptureFixture[str]) -> None:
    """`sweep._terminate` (Ctrl-C, SIGTERM) returns once the pool's manager thread is gone: at the interpreter's
    exit concurrent.futures writes to the pipe that thread closes, without its lock, and a close under way then
    printed `OSError: Bad file descriptor`. Once stopping, the queue feeder's write errors print nothing."""
    import time
    from concurrent.futures import ProcessPoolExecutor

    ex = ProcessPoolExecutor(max_workers=1, mp_context=sweep._worker_context())  # pyright: ignore[reportPrivateUsage]
    stopping = sweep._quiet_feeder(ex)  # pyright: ignore[reportPrivateUsage]
    ex.submit(time.sleep, 60)
    manager, queue = cast(Any, ex)._executor_manager_thread, cast(Any, ex)._call_queue  # concurrent.futures' own
    assert manager is not None and manager.is_alive() and queue is not None
    stopping.set()
    sweep._terminate(ex)  # pyright: ignore[reportPrivateUsage]
    assert not manager.is_alive()
    capfd.readouterr()
    queue._on_queue_feeder_error(OSError(9, "Bad file descriptor"), None)  # what the feeder thread calls
    assert capfd.readouterr().err == ""
