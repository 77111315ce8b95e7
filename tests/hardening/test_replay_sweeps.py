"""Issue 22 items 8, 5 and 6 for replay and sweeps, through the real `qnpipe` command in subprocesses.

A slow simulated device is a result, not a stall; `cost.*` values are checked as `device.*`
values are; a 10^9-point grid fails at once, naming its count; profile and cost files are
regular files of bounded size and counts; one failing sweep point is reported and the rest
complete; killing `qnpipe sweep` (SIGTERM, SIGKILL) leaves none of its processes behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from cli_harness import MEM_LIMIT, Case, check_table, clean_env

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.io.device_file import MeasuredProfile, ReadSample, save_profile
from qnpipe.io.simssd import DeviceProfile
from qnpipe.replay import sweep
from qnpipe.replay.synth import SynthSpec, write_synth

NBYTES = 1_000_000
REC = f"replay.record_nbytes={NBYTES}"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small routing log (10 one-token steps of 2 MoE layers), a FIFO, good and bad profile and cost files."""
    root = tmp_path_factory.mktemp("rs")
    write_synth(root / "r.qtrace", SynthSpec(layers=2, experts=16, top_k=2, tokens=10, seed=1))
    os.mkfifo(root / "fifo")
    (root / "dir.json").mkdir()
    with open(root / "huge.json", "wb") as f:  # sparse: 100 MB of nothing
        f.truncate(100 << 20)

    def profile(name: str, samples: int = 1, **p: float) -> None:
        dev = DeviceProfile(**{"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4, **p})  # type: ignore[arg-type]
        one = ReadSample(record_nbytes=4096, qd=1, reads_per_s=1e3, bytes_per_s=4e6)
        # written as msgspec would, but unchecked: the file is the bad input
        raw = msgspec.to_builtins(MeasuredProfile(profile=dev, latency_fit_residual_s=0.0, rate_fit_residual=0.0,
                                                  backend="python", mode="buffered", samples=[one] * samples))
        (root / name).write_bytes(msgspec.json.encode(raw))

    profile("slow.json", bandwidth_bytes_per_s=1000.0)  # 1 KB/s: a 1 MB read takes 1000 virtual s
    profile("many.json", samples=200_000)
    (root / "nan.json").write_text((root / "slow.json").read_text().replace('"latency_s":0.0001', '"latency_s":1e999'))
    save_profile(root / "good.json", MeasuredProfile(
        profile=DeviceProfile(bandwidth_bytes_per_s=1e9, latency_s=1e-4), latency_fit_residual_s=0.0,
        rate_fit_residual=0.0, backend="python", mode="buffered", samples=[]))

    def cost(name: str, **c: object) -> None:
        (root / name).write_text(json.dumps({
            "kind": "qnpipe.cost-model", "version": 1, "cost": {"per_layer_s": 1e-3, **c}, "log": "x", "samples": 1,
            "pauses": 0, "steps": 1, "fitted": [], "rms_residual_s": 0.0, "mean_gap_s": 0.0, "live_s": 0.0}))

    cost("cost.json")
    cost("cost_neg.json", per_step_s=-0.5)
    cost("cost_inf.json", read_hop_s=1.5)
    (root / "cost_inf.json").write_text((root / "cost_inf.json").read_text().replace("1.5", "1e999"))
    cost("cost_big.json", per_token_s=1e300)
    cost("cost_table_neg.json", layer_table={"0": -1.0})
    cost("cost_table_many.json", layer_table={str(i): 1e-3 for i in range(200_000)})
    return root


def _grid(n: int, start: int = 1) -> str:
    return ",".join(str(start + i) for i in range(n))


@pytest.mark.slow
def test_replay_and_sweep_inputs(d: Path) -> None:
    log = d / "r.qtrace"
    rp = ["replay", log, "--set", REC, "--set", "pool.expert_slots=4"]
    sw = ["sweep", log, "--set", REC, "--no-progress"]
    measured = ["--device", "measured", "--set"]
    check_table([
        # item 8: a slow device is a result (virtual time runs for hours), not a StallError
        Case("slow device by --set", [*rp, "--set", "device.bandwidth_bytes_per_s=1000"], 0, ("10 steps",)),
        Case("slow measured profile", [*rp, *measured, f"read.device_profile_path={d / 'slow.json'}"], 0,
             ("10 steps",)),
        Case("slow device in a sweep", [*sw, "--grid", "device.bandwidth_bytes_per_s=1000,1e9", "--executor",
                                        "serial"], 0, ("2 points",)),
        Case("good cost file", [*rp, "--cost", d / "cost.json"], 0, ("10 steps",)),
        # item 8: cost.* checked as device.* is
        Case("negative cost by --set", [*rp, "--set", "cost.per_layer_s=-1"], 2, ("cost.per_layer_s", "-1")),
        Case("NaN cost by --set", [*rp, "--set", "cost.per_token_s=nan"], 2, ("cost.per_token_s", "nan")),
        Case("inf cost by --set", [*rp, "--set", "cost.read_hop_s=inf"], 2, ("cost.read_hop_s", "inf")),
        Case("absurd cost by --set", [*rp, "--set", "cost.per_step_s=1e300"], 2, ("cost.per_step_s", "1e+300")),
        Case("not a number cost", [*rp, "--set", "cost.per_step_s=fast"], 2, ("cost.per_step_s", "fast")),
        Case("negative cost in a file", [*rp, "--cost", d / "cost_neg.json"], 2,
             ("cost_neg.json", "cost.per_step_s", "-0.5")),
        Case("inf cost in a file", [*rp, "--cost", d / "cost_inf.json"], 2, ("cost_inf.json", "cost.read_hop_s")),
        Case("absurd cost in a file", [*rp, "--cost", d / "cost_big.json"], 2,
             ("cost_big.json", "cost.per_token_s", "1e+300")),
        Case("negative layer_table entry", [*rp, "--cost", d / "cost_table_neg.json"], 2,
             ("cost_table_neg.json", "layer_table", "-1")),
        Case("200000 layer_table entries", [*rp, "--cost", d / "cost_table_many.json"], 2,
             ("cost_table_many.json", "layer_table", "200000")),
        Case("bad cost on a grid", [*sw, "--grid", "cost.per_layer_s=0.001,-2"], 2, ("cost.per_layer_s=-2",)),
        Case("NaN cost by sweep --set", [*sw, "--grid", "pool.expert_slots=4", "--set", "cost.per_layer_s=nan"], 2,
             ("cost.per_layer_s", "nan")),
        Case("absurd device latency", [*rp, "--set", "device.latency_s=1e300"], 2, ("device.latency_s", "1e+300")),
        Case("inf device bandwidth", [*rp, "--set", "device.bandwidth_bytes_per_s=inf"], 2,
             ("device.bandwidth_bytes_per_s", "inf")),
        Case("inf latency in a profile", [*rp, *measured, f"read.device_profile_path={d / 'nan.json'}"], 2,
             ("nan.json", "latency_s")),
        Case("absurd record size", ["replay", log, "--set", f"replay.record_nbytes={10**30}"], 2,
             ("replay.record_nbytes", str(10**30))),
        # item 5: a 10^9-point grid is refused before anything is built
        Case("10^9-point grid", [*sw, "--grid", f"pool.expert_slots={_grid(1000, 2)}",
                                 f"device.queue_depth={_grid(1000)}", f"cost.per_layer_s={_grid(1000)}"], 2,
             ("1000000000 points", "pool.expert_slots", "1000 values"), timeout=20),
        Case("200000 samples in a profile", [*rp, *measured, f"read.device_profile_path={d / 'many.json'}"], 2,
             ("many.json", "200000 samples")),
        Case("100 MB profile", [*rp, *measured, f"read.device_profile_path={d / 'huge.json'}"], 2,
             ("huge.json", "too large")),
        Case("100 MB cost file", [*rp, "--cost", d / "huge.json"], 2, ("huge.json", "too large")),
        # item 6: a FIFO, a directory or a device is refused, never read (a FIFO would block for good)
        Case("FIFO as --cost", [*rp, "--cost", d / "fifo"], 2, ("fifo", "FIFO"), timeout=20),
        Case("directory as --cost", [*rp, "--cost", d / "dir.json"], 2, ("dir.json", "directory")),
        Case("/dev/zero as --cost", [*rp, "--cost", "/dev/zero"], 2, ("/dev/zero", "device"), timeout=20),
        Case("FIFO as the measured profile", [*rp, *measured, f"read.device_profile_path={d / 'fifo'}"], 2,
             ("fifo", "FIFO"), timeout=20),
        Case("FIFO as fit-cost's profile", ["trace", "fit-cost", log, "-o", d / "out.cost.json", *measured,
                                            f"read.device_profile_path={d / 'fifo'}"], 2, ("fifo", "FIFO"),
             timeout=20),
        Case("FIFO as a capacity profile", [*rp, "--set", f"pool.capacity_profile_path={d / 'fifo'}"], 2,
             ("fifo", "FIFO"), timeout=20),
        Case("FIFO as a sweep's capacity profile", [*sw, "--grid", f"pool.capacity_profile_path={d / 'fifo'}"], 2,
             ("fifo", "FIFO"), timeout=20),
        # outputs are checked before the work, not after it
        Case("sweep -o a directory", [*sw, "--grid", "pool.expert_slots=4", "-o", d / "dir.json"], 2,
             ("dir.json", "is a directory")),
        Case("fit-cost -o a FIFO", ["trace", "fit-cost", log, "-o", d / "fifo"], 2, ("fifo", "not a regular file")),
        Case("bench io -o a directory", ["bench", "io", "--dir", d, "--size-mib", "1", "--seconds", "0.01", "-q",
                                         "-o", d / "dir.json"], 2, ("dir.json", "is a directory")),
        Case("a point's event log in no directory", [*sw, "--grid", f"trace.event_log_path={d / 'a.qtrace'},"
                                                     f"{d / 'no' / 'b.qtrace'}"], 2,
             ("grid point trace.event_log_path=", "b.qtrace", "does not exist")),
        Case("good measured profile", [*rp, *measured, f"read.device_profile_path={d / 'good.json'}"], 0,
             ("10 steps",)),
    ], cwd=d)
    assert not (d / "out.cost.json").exists()


def test_a_10e9_point_grid_fails_before_any_work(d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from the axes' lengths alone: the log is not read and not one point is checked."""
    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan did work before it counted the points")

    axes = sweep.parse_grid([f"pool.expert_slots={_grid(1000, 2)}", f"device.queue_depth={_grid(1000)}",
                             f"cost.per_layer_s={_grid(1000)}"])
    monkeypatch.setattr(sweep, "load_log", no_work)
    monkeypatch.setattr(sweep, "split_settings", no_work)
    with pytest.raises(ConfigError, match=r"1000000000 points"):
        sweep.plan(d / "r.qtrace", axes, config.load(None, env={}), fixed={"replay.record_nbytes": NBYTES})


@pytest.mark.slow
def test_one_failing_point_is_reported_and_the_rest_complete(d: Path) -> None:
    """`recorded` needs a live run's candidates, which a routing log lacks: that point fails when replayed."""
    from cli_harness import run_cli

    out = d / "sweep.json"
    r = run_cli(["sweep", d / "r.qtrace", "--set", REC, "--no-progress", "--jobs", "2",
                 "--grid", "replay.predictor=none,recorded,previous", "-o", out], cwd=d)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "Traceback" not in err
    assert "1 of 3 points failed" in err and "replay.predictor=recorded" in err and "predict.candidates" in err
    table = r.stdout.decode()
    assert "failed" in table and "none" in table and "previous" in table
    got = json.loads(out.read_bytes())
    assert [p["values"]["replay.predictor"] for p in got["points"]] == ["none", "recorded", "previous"]
    ok, bad, ok2 = got["points"]
    assert ok["report"]["steps"] == ok2["report"]["steps"] == 10 and ok["error"] is None
    assert bad["report"] is None and bad["metrics"] == {} and "predict.candidates" in bad["error"]


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["serial", "processes", "dask"])
def test_a_point_failing_on_any_executor_keeps_the_others(d: Path, executor: str) -> None:
    points = sweep.plan(d / "r.qtrace", sweep.parse_grid(["replay.predictor=previous,recorded,none"]),
                        config.load(None, env={}), fixed={"replay.record_nbytes": NBYTES})
    if executor == "dask":
        from typing import Any, cast

        from dask.distributed import LocalCluster

        cluster: Any = LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                    dashboard_address=cast(Any, None))
        with cluster:
            result = sweep.run(d / "r.qtrace", points, executor="dask", scheduler=cluster.scheduler_address)
    else:
        result = sweep.run(d / "r.qtrace", points, executor=executor, jobs=2)
    assert [p.error is None for p in result.points] == [True, False, True]
    assert result.points[1].error is not None
    assert "grid point 1 (replay.predictor=recorded)" in result.points[1].error
    assert result.points[0].report is not None and result.points[2].report is not None
    assert result.failed == [1]


def test_the_watchdog_counts_a_slow_simulated_device_as_time_and_a_deadlock_as_a_stall(d: Path) -> None:
    """In virtual time a read of 10^4 s is a result; a step that nothing can ever wake again is a StallError."""
    from qnpipe.errors import StallError
    from qnpipe.replay import replay

    cfg = config.load(None, env={}, overrides={"diag.watchdog_s": 2.0, "pool.expert_slots": 4})
    slow = DeviceProfile(bandwidth_bytes_per_s=100.0, latency_s=0.0)
    r = replay(d / "r.qtrace", cfg, device_profile=slow, record_nbytes=NBYTES)
    assert r.steps == 10 and r.virtual_s > 1e4

    import trio
    import trio.testing

    from qnpipe.actors.pipeline import open_pipeline
    from qnpipe.steps import LayerRoute

    class Hung:
        async def read(self, jobs: object) -> list[int]:
            await trio.sleep_forever()
            raise AssertionError

        def statistics(self) -> None:
            return None

    class OneLayer:
        async def begin(self, inputs: object, cache: object, tail: object) -> LayerRoute:
            import numpy as np

            return LayerRoute(0, np.array([[1, 2]]))

        async def resume(self, grant: object) -> object:
            raise AssertionError("the device never answers")

        async def abort(self) -> None:
            pass

    async def deadlock() -> None:
        async with open_pipeline(cfg, OneLayer(), num_experts=8, capacities={0: 4}, device=Hung(),
                                 record_nbytes={0: 100}) as p:
            await p.forward.run(None, None, lambda h: None)

    with pytest.raises(BaseExceptionGroup) as got:
        trio.run(deadlock, clock=trio.testing.MockClock(autojump_threshold=0))
    stall = got.value.subgroup(StallError)
    assert stall is not None and "no progress for 2.0 s" in str(stall.exceptions[0])


def test_a_point_that_kills_its_worker_fails_alone(d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed in a point (the OOM killer) breaks its pool; the points it took down run again, each alone."""
    import multiprocessing

    real = sweep.replay

    def die_at_5(path: object, cfg: config.Config, **kw: object) -> object:
        if cfg.pool.expert_slots == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, cfg, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sweep, "replay", die_at_5)
    # forked workers (not the fork server's fresh imports) run the patched replay
    monkeypatch.setattr(sweep, "_worker_context", lambda: multiprocessing.get_context("fork"))
    points = sweep.plan(d / "r.qtrace", sweep.parse_grid(["pool.expert_slots=4,5,6,7"]), config.load(None, env={}),
                        fixed={"replay.record_nbytes": NBYTES})
    result = sweep.run(d / "r.qtrace", points, executor="processes", jobs=2)
    assert result.failed == [1]
    assert result.points[1].error is not None and "worker process died" in result.points[1].error
    assert [p.report is not None for p in result.points] == [True, False, True, True]


# ---------------------------------------------------------------------------- killing a sweep


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of `pid` from /proc, or None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time (so a reused pid is not mistaken for it)."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            procs[int(entry.name)] = s
    out: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state, start) in procs.items():
            if ppid == parent and pid not in out and state != "Z":
                out[pid] = start
                frontier.append(pid)
    return out


def _cpu_ticks(pid: int) -> int:
    """The CPU time `pid` has used (user + system, in clock ticks), 0 when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def _survivors(procs: dict[int, int]) -> list[int]:
    return [pid for pid, start in procs.items() if (s := _stat(pid)) is not None and s[2] == start and s[1] != "Z"]


BUSY_TICKS = os.sysconf("SC_CLK_TCK") // 4  # a quarter of a CPU second in a worker: past its start, replaying


@pytest.fixture(scope="module")
def long_log(d: Path) -> Path:
    """About 8 s of replay per point on this machine: a sweep of it is still running when killed."""
    return write_synth(d / "long.qtrace", SynthSpec(layers=4, experts=64, top_k=4, tokens=2000, seed=2))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_a_sweep_leaves_no_process_behind(long_log: Path, sig: signal.Signals) -> None:
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))

    # stderr to a file: a surviving worker would hold a pipe open, and reading it would hang the test
    errf = (long_log.parent / f"sweep-{sig.name}.err").open("w+b")
    p = subprocess.Popen([sys.executable, "-m", "qnpipe", "sweep", str(long_log), "--set", "replay.record_nbytes=100000",
                          "--grid", "pool.expert_slots=8,9,10,11", "--jobs", "2", "--no-progress"],
                         stdout=subprocess.DEVNULL, stderr=errf, env=clean_env(), preexec_fn=limit)
    procs: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 30
        # the fork server (or none where workers are spawned) and two workers, all replaying
        while len(procs) < 3 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
            procs = _descendants(p.pid)
        assert len(procs) >= 2, f"the sweep started no workers: {procs}"
        # The workers are inside their first replay once two of them (leaves: the fork server has children;
        # forked from it, a worker imports nothing) have computed for a while: work counted, not waited for.
        busy: list[int] = []
        while len(busy) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
            procs |= _descendants(p.pid)
            parents = {s[0] for pid in procs if (s := _stat(pid)) is not None}
            busy = [pid for pid in procs if pid not in parents and _cpu_ticks(pid) >= BUSY_TICKS]
        assert len(busy) >= 2, f"no two workers replaying: {procs}"
        p.send_signal(sig)
        p.wait(timeout=20)
        errf.seek(0)
        err = errf.read()
        left = _survivors(procs)
        until = time.monotonic() + 10
        while left and time.monotonic() < until:
            time.sleep(0.1)
            left = _survivors(procs)
        assert not left, f"left behind after {sig.name}: {left} of {sorted(procs)}"
        if sig == signal.SIGTERM:
            assert p.returncode == 128 + signal.SIGTERM, err.decode()
            assert b"Traceback" not in err and b"terminated" in err
    finally:
        errf.close()
        for pid in _survivors(procs):  # only this test's own processes, by pid
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
