"""Sweeps: one replay per point of a grid of settings, run in parallel processes or on a Dask cluster.

    axes = parse_grid(["pool.expert_slots=16,32,64", "predict.width_experts=8,16"])
    points = plan("run.qtrace", axes, cfg)          # every point checked: nothing has run yet
    result = run("run.qtrace", points, executor="processes", jobs=2)

A grid field is any config field (a dotted path, or a short name that config resolves to one
section) or one of the replay's own settings (`cost.*`, `device.*`, `replay.record_nbytes`,
`replay.predictor`). `plan` builds and checks every point before anything runs, so an unknown
field or a bad value fails at once, naming it. Each point is a `qnpipe.replay.replay`, which is
deterministic, so results are the same on every executor; they come back in grid order.
A point that fails while it replays is reported as failed (`PointResult.error`) and the
others still run; under the processes executor a point over its time limit (`point_timeout_s`,
`qnpipe sweep --point-timeout`) is killed and fails the same way. Remote Dask workers need
qnpipe importable and the log at the same path.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.config import Config, with_overrides
from qnpipe.config.tree import DASK_CONNECT_TIMEOUT_S
from qnpipe.errors import ConfigError, QnpipeError
from qnpipe.io.atomic import atomic_write
from qnpipe.io.sim_model import PROFILES, DeviceProfile
from qnpipe.policy.build import check_placement
from qnpipe.replay.caveats import spans
from qnpipe.replay.cost import CostModel
from qnpipe.replay.log import load_log
from qnpipe.replay.predictors import PredictorOpts
from qnpipe.replay.report import ReplayReport, fmt_value, metric_names, metrics
from qnpipe.replay.runner import replay, replay_capacities
from qnpipe.replay.settings import REPLAY_KEYS, Settings, replay_keys, resolve_key, settings_of, split_settings
from qnpipe.replay.sweep_result import (
    TABLE_METRICS,
    PointResult,
    SweepResult,
    check_metric,
    fmt_metric,
    table_metrics,
)
from qnpipe.trace import check_log_paths
from qnpipe.trace.format import partial_path

EXECUTORS = ("processes", "dask", "serial")
# Points in one sweep: a replay takes ~0.1 s to minutes, so more is days of work, and each
# point's config is built before anything runs.
MAX_POINTS = 100_000
# A point's time limit under the processes executor (`qnpipe sweep --point-timeout`, 0 = none): a replay
# takes ~0.1 s to minutes, so an hour is a point that will not end (a plug-in's call that never returns).
POINT_TIMEOUT_S = 3600.0
_LOOK_S = 0.2  # how often the sweep looks for points over their time limit


class Axis(msgspec.Struct, frozen=True, kw_only=True):
    """One swept field: its dotted name and its values as given (text)."""

    field: str
    values: tuple[str, ...]


def parse_grid(items: Sequence[str]) -> list[Axis]:
    """`KEY=V1,V2,...` items as axes; values are split on `;` instead when the list holds one
    (for values with commas, such as layer sets: `trace.route_trace_layers=0-3;4,6`). ConfigError names the item."""
    axes: list[Axis] = []
    for item in items:
        key, sep, rest = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. pool.expert_slots=16,32)")
        try:
            field = resolve_key(key)
        except ConfigError as e:
            raise ConfigError(f"--grid {item!r}: {e}") from None
        values = tuple(v.strip() for v in rest.split(";" if ";" in rest else ","))
        if not rest.strip() or any(not v for v in values):
            raise ConfigError(f"--grid {item!r}: an empty value in the list of {field}")
        if field in (a.field for a in axes):
            raise ConfigError(f"--grid {item!r}: {field} is already swept by another --grid")
        axes.append(Axis(field=field, values=values))
    if not axes:
        raise ConfigError("no --grid given: name at least one field to sweep, e.g. --grid pool.expert_slots=16,32")
    return axes


class Point(msgspec.Struct, frozen=True, kw_only=True):
    """One replay of a sweep, checked and ready to run anywhere (picklable)."""

    index: int
    values: dict[str, Any]  # swept field -> value as the replay uses it, in axis order
    cfg: Config
    device: DeviceProfile
    cost: CostModel
    record_nbytes: int | None
    predictor: str
    step_order: str = "id"
    opts: PredictorOpts = PredictorOpts()


def _typed(field: str, cfg: Config, s: Settings) -> Any:
    section, _, name = field.partition(".")
    if section in ("cost", "device"):
        return getattr(s.cost if section == "cost" else s.device, name)
    if section == "replay":
        if name in ("train_frac", "recall", "seed"):
            return getattr(s.opts, name)
        return {"record_nbytes": s.record_nbytes, "step_order": s.step_order}.get(name, s.predictor)
    return msgspec.to_builtins(getattr(getattr(cfg, section), name))


def count_points(axes: Sequence[Axis]) -> int:
    """The grid's number of points; ConfigError naming each field's count when above MAX_POINTS."""
    n = math.prod(len(a.values) for a in axes)
    if n > MAX_POINTS:
        sizes = " x ".join(f"{a.field}: {len(a.values)} values" for a in axes)
        raise ConfigError(f"the grid has {n} points ({sizes}): a sweep runs at most {MAX_POINTS}")
    return n


def plan(log: str | Path, axes: Sequence[Axis], cfg: Config, *, base: Settings | None = None,
         fixed: Mapping[str, Any] | None = None, equal_memory: bool = False) -> list[Point]:
    """Every point of the grid (the cartesian product, last axis fastest), each checked as its replay
    would check it: values, config rules, device, predictor, capacities against the log's model and
    the record size. `fixed`: replay settings (`cost.*`, `device.*`, `replay.*`) of every point, over
    `base`. `equal_memory`: a demand-only point (predictor none, prefetch off) gets the side region's
    slots as resident ones (`pool.expert_slots` + `pool.side_region_slots`), so it has the memory a
    prefetch point of the same settings has. ConfigError names the point and the setting; nothing has run yet."""
    base = base if base is not None else Settings(device=PROFILES["apple-m5-internal"], cost=CostModel())
    count_points(axes)
    shape = load_log(log)
    points: list[Point] = []
    logs: dict[str, int] = {}  # event or routing log written by a point -> the point
    for index, combo in enumerate(itertools.product(*(a.values for a in axes))):
        given = dict(zip((a.field for a in axes), combo, strict=True))
        where = "grid point " + ", ".join(f"{k}={v}" for k, v in given.items())
        conf, own = split_settings({**(fixed or {}), **given})
        s = settings_of(own, base, where)
        try:
            pcfg = with_overrides(cfg, conf) if conf else cfg
            if equal_memory:
                pcfg = _equal_memory(pcfg, s.predictor)
            if s.predictor != "none":
                check_placement(with_overrides(pcfg, {"predict.cross_layer_prefetch": True}))
            caps = replay_capacities(pcfg, shape.shape)
            check_log_paths(pcfg)
        except QnpipeError as e:
            raise ConfigError(f"{where}: {e}") from None
        if s.record_nbytes is None and not set(caps) <= set(shape.record_nbytes):
            raise ConfigError(f"{where}: the log {log} has no read.done record of layers "
                              f"{spans(set(caps) - set(shape.record_nbytes))}: give the record size "
                              f"(--set replay.record_nbytes=N)")
        for path in (pcfg.trace.event_log_path, pcfg.trace.route_trace_path if pcfg.trace.route_trace else ""):
            if path and path in logs:
                raise ConfigError(f"{where}: writes the log {path} that grid point {logs[path]} writes too: "
                                  f"sweep trace.event_log_path (or leave it unset) so each point has its own")
            if path:
                logs[path] = index
        points.append(Point(index=index, values={a.field: _typed(a.field, pcfg, s) for a in axes}, cfg=pcfg,
                            device=s.device, cost=s.cost, record_nbytes=s.record_nbytes, predictor=s.predictor,
                            step_order=s.step_order, opts=s.opts))
    return points


def _equal_memory(cfg: Config, predictor: str) -> Config:
    """`cfg` with a demand-only run's side slots made resident (the memory of the same settings with prefetch)."""
    if predictor != "none" or cfg.predict.cross_layer_prefetch:
        return cfg
    if cfg.pool.capacity_profile_path:
        raise ConfigError("--equal-memory adds pool.side_region_slots to pool.expert_slots: it cannot with "
                          f"pool.capacity_profile_path={cfg.pool.capacity_profile_path} (per-layer capacities)")
    return with_overrides(cfg, {"pool.expert_slots": cfg.pool.expert_slots + cfg.pool.side_region_slots})


def run_point(log: str, point: Point) -> ReplayReport:
    """The replay of one point (a top-level function: worker processes and Dask workers import it)."""
    return replay(log, point.cfg, device_profile=point.device, cost=point.cost, record_nbytes=point.record_nbytes,
                  predictor=point.predictor, opts=point.opts, step_order=point.step_order)


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker sends back: the report, or why the point failed (text: every error travels, pickled or not)."""

    report: ReplayReport | None = None
    error: str | None = None


def point_outcome(log: str, point: Point) -> Outcome:
    """`run_point`, its failure caught (a top-level function: worker processes and Dask workers import it)."""
    try:
        return Outcome(report=run_point(log, point))
    except Exception as e:  # one point's failure is its result, the sweep goes on
        return Outcome(error=_failure(point, e))


def _failure(p: Point, e: BaseException) -> str:
    where = ", ".join(f"{k}={v}" for k, v in p.values.items())
    what = str(e) if isinstance(e, QnpipeError) else f"{type(e).__name__}: {e}"
    return f"grid point {p.index} ({where}): {what}"


Progress = Callable[[int, int], None]  # (points done, points in all)


def run(log: str | Path, points: Sequence[Point], *, executor: str = "processes", jobs: int | None = None,
        scheduler: Any = None, progress: Progress | None = None,
        connect_timeout_s: float = DASK_CONNECT_TIMEOUT_S, point_timeout_s: float = POINT_TIMEOUT_S) -> SweepResult:
    """Replay every point: "processes" (`jobs` worker processes, default the machine's cores),
    "dask" (`scheduler`: a scheduler address, connected to within `connect_timeout_s`, or a
    `dask.distributed.Client`) or "serial" (here).
    Results are in grid order whatever the executor; a point that fails (its replay raises, its
    worker dies, or, with "processes", it runs longer than `point_timeout_s` > 0 and is killed) is
    a `PointResult` with its `error`, and the other points still run."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor {executor!r}: unknown, known: {', '.join(EXECUTORS)}")
    if not point_timeout_s >= 0:
        raise ConfigError(f"point time limit {point_timeout_s!r}: must be >= 0 seconds (0 = none)")
    log = str(log)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(points))

    if progress is not None:
        progress(0, len(points))
    if executor == "serial" or not points:
        outcomes = []
        for p in points:
            outcomes.append(point_outcome(log, p))
            tick()
    elif executor == "processes":
        outcomes = _run_processes(log, points, jobs or os.cpu_count() or 1, tick, point_timeout_s)
    else:
        if scheduler is None:
            raise ConfigError("the dask executor needs a scheduler address (--scheduler tcp://HOST:8786)")
        outcomes = _run_dask(log, points, scheduler, tick, connect_timeout_s)
    return SweepResult(log=log, fields=list(points[0].values) if points else [],
                       points=[PointResult(index=p.index, values=p.values, report=o.report, error=o.error,
                                           metrics=metrics(o.report) if o.report is not None else {})
                               for p, o in zip(points, outcomes, strict=True)])


def _worker_context() -> Any:
    """Workers forked from a fork server that imported qnpipe once (this module: replay, numpy),
    or spawned where there is none. Not a plain fork: this process may hold threads (MLX, a progress
    bar) that fork would copy half-way. Measured here: a 4-point sweep on 2 workers took 6.8 s with a
    new fork server, 0.7 s with a running one, 14-19 s spawning (each worker imports qnpipe anew)."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


# In a worker: where it notes when it starts each point, and which process runs it (set by _worker_init).
_starts: Any = None
_pids: Any = None


def _worker_init(starts: Any = None, pids: Any = None) -> None:
    """Make the worker die with the sweep, and keep where it notes each point's start (`starts`, `pids`).

    A worker whose sweep was killed (SIGKILL, the OOM killer) would run its point to the end,
    then wait for work forever. Its parent is the fork server, which outlives the sweep while
    workers hold its pipe, so PR_SET_PDEATHSIG would never fire; the pipe behind
    `parent_process().sentinel` is the sweep's own (forkserver and spawn alike): it reads EOF
    when the sweep is gone, and a daemon thread waits for that.
    """
    global _starts, _pids
    _starts, _pids = starts, pids
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="qnpipe-sweep-parent", daemon=True).start()


def _point_in_worker(log: str, point: Point, i: int) -> Outcome:
    """`point_outcome`, its start (`i`: its place in the sweep) and this process noted first: the sweep
    kills the point when it overruns."""
    if _starts is not None and _pids is not None:
        _pids[i] = os.getpid()
        _starts[i] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    return point_outcome(log, point)


def _run_processes(log: str, points: Sequence[Point], jobs: int, tick: Callable[[], None],
                   limit_s: float = 0.0) -> list[Outcome]:
    out: list[Outcome | None] = [None] * len(points)
    lost, killed = _pool_pass(log, points, range(len(points)), jobs, tick, out, limit_s)
    # A point killed at its time limit breaks the pool: the points it took down did nothing wrong, so they
    # run again together, until a pass kills none.
    while killed and lost:
        lost, killed = _pool_pass(log, points, lost, jobs, tick, out, limit_s)
    # A worker that dies (killed, out of memory) breaks the pool and every point still in it: run
    # those again, each alone, so only the one that kills its worker is reported.
    for i in lost:
        if _pool_pass(log, points, [i], 1, tick, out, limit_s)[0]:
            out[i] = Outcome(error=_failure(points[i], RuntimeError("its worker process died (killed, out of memory?)")))
            tick()
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


def _pool_pass(log: str, points: Sequence[Point], which: Iterable[int], jobs: int, tick: Callable[[], None],
               out: list[Outcome | None], limit_s: float = 0.0) -> tuple[list[int], bool]:
    """Run `points[i]` for each i in `which` on a new pool, the outcomes into `out`; (the points a broken pool
    lost, whether a point was killed at its time limit `limit_s` (0: none), its outcome saying so)."""
    which = list(which)
    starts = RawArray("d", len(points))  # the monotonic time each point started at, 0 before
    pids = RawArray("i", len(points))
    ex = ProcessPoolExecutor(max_workers=max(1, min(jobs, len(which))), mp_context=_worker_context(),
                             initializer=_worker_init, initargs=(starts, pids))
    stopping = _quiet_feeder(ex)
    lost: list[int] = []
    killed: set[int] = set()
    try:
        futures: dict[Future[Outcome], int] = {ex.submit(_point_in_worker, log, points[i], i): i for i in which}
        waiting = set(futures)
        while waiting:
            done, waiting = wait(waiting, timeout=_LOOK_S if limit_s > 0 else None, return_when=FIRST_COMPLETED)
            for f in done:
                i = futures[f]
                if i in killed:  # its outcome says why already
                    continue
                try:
                    out[i] = f.result()
                except BrokenProcessPool:
                    lost.append(i)
                    continue
                except Exception as e:  # the outcome could not come back (pickling): this point's failure
                    out[i] = Outcome(error=_failure(points[i], e))
                tick()
            if limit_s > 0:
                for i in _overrun(waiting, futures, starts, pids, limit_s, killed):
                    out[i] = Outcome(error=_failure(points[i], QnpipeError(
                        f"over its time limit of {limit_s:g} s (--point-timeout): its worker was killed")))
                    _remove_partial_logs([points[i]])
                    tick()
    except BaseException:
        stopping.set()
        _terminate(ex)  # Ctrl-C, SIGTERM: the points running would otherwise finish first
        _remove_partial_logs([points[i] for i in which if out[i] is None])
        raise
    ex.shutdown()
    return sorted(lost), bool(killed)


def _overrun(waiting: set[Future[Outcome]], futures: dict[Future[Outcome], int], starts: Any, pids: Any,
             limit_s: float, killed: set[int]) -> list[int]:
    """Kill the worker of each point still running `limit_s` after it started; the points killed now."""
    now = time.monotonic()
    out = []
    for f in waiting:
        i = futures[f]
        if i in killed or f.done() or not starts[i] or now - starts[i] < limit_s:
            continue
        try:
            os.kill(pids[i], signal.SIGKILL)  # the pool's own worker: a plug-in's call may never return
        except ProcessLookupError:
            pass
        killed.add(i)
        out.append(i)
    return out


def _quiet_feeder(ex: ProcessPoolExecutor) -> threading.Event:
    """An event that, once set, keeps the pool's queue feeder thread from printing a traceback when a write to a
    worker fails (its pipe closed under it while `_terminate` tears the pool down: stderr would show an
    `OSError: Bad file descriptor` for a stop that went as it should). Before the first submit: the feeder
    thread takes its error handler when it starts."""
    stopping = threading.Event()
    queue = getattr(ex, "_call_queue", None)  # concurrent.futures' own (CPython 3.11-3.13)
    inner = getattr(queue, "_on_queue_feeder_error", None)
    if queue is not None and inner is not None:

        def on_error(e: BaseException, obj: object) -> None:
            if not stopping.is_set():
                inner(e, obj)

        queue._on_queue_feeder_error = on_error  # pyright: ignore[reportAttributeAccessIssue]
    return stopping


def _terminate(ex: ProcessPoolExecutor) -> None:
    """Stop the pool's workers now, not after their points (concurrent.futures has no public way before 3.14)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    manager = getattr(ex, "_executor_manager_thread", None)  # shutdown forgets both
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    # Its manager thread closes the pool's wake-up pipe on its way out; at the interpreter's exit
    # concurrent.futures writes to that pipe without its lock (CPython 3.11), so a close under way then is
    # an `OSError: Bad file descriptor` on stderr. Let the thread finish first.
    if manager is not None:
        manager.join(timeout=5)


def _remove_partial_logs(points: Iterable[Point]) -> None:
    """The logs the terminated workers of `points` were writing: a worker killed mid-point cannot remove its own."""
    for p in points:
        for path in (p.cfg.trace.event_log_path, p.cfg.trace.route_trace_path if p.cfg.trace.route_trace else ""):
            if path:
                partial_path(path).unlink(missing_ok=True)


def _run_dask(log: str, points: Sequence[Point], scheduler: Any, tick: Callable[[], None],
              connect_timeout_s: float) -> list[Outcome]:
    from dask.distributed import Client, as_completed

    from qnpipe.replay.dask_connect import connect

    client = scheduler if isinstance(scheduler, Client) else connect(scheduler, connect_timeout_s)
    try:
        # pure=False: each point is its own task (no hashing of the configs for a cache key).
        futures = client.map(point_outcome, [log] * len(points), list(points), pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        out: list[Outcome | None] = [None] * len(points)
        try:
            for f in as_completed(futures):
                i = index[f.key]
                try:
                    out[i] = f.result()
                except Exception as e:  # its worker died (KilledWorker), the task could not travel
                    out[i] = Outcome(error=_failure(points[i], e))
                tick()
        except BaseException:
            client.cancel(futures)
            raise
        return [o if o is not None else Outcome(error=_failure(p, RuntimeError("no result came back")))
                for o, p in zip(out, points, strict=True)]
    finally:
        if client is not scheduler:
            client.close()


def to_json(result: SweepResult) -> bytes:
    """The sweep as JSON: points in grid order, each with its values, metrics and whole replay report."""
    return msgspec.json.encode(result)


def write_json(result: SweepResult, path: str | Path) -> Path:
    """Write `to_json(result)` to `path` through a temporary name (never a torn file)."""
    path = Path(path)
    atomic_write(path, to_json(result) + b"\n")
    return path


__all__ = ["EXECUTORS", "MAX_POINTS", "POINT_TIMEOUT_S", "REPLAY_KEYS", "TABLE_METRICS", "Axis", "Outcome", "Point", "PointResult", "Settings",
           "SweepResult", "check_metric", "count_points", "fmt_metric", "fmt_value", "metric_names", "metrics",
           "parse_grid", "plan", "point_outcome", "replay_keys", "resolve_key", "run", "run_point", "split_settings",
           "table_metrics", "to_json", "write_json"]
