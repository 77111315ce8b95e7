"""`qnpipe sweep`: a grid of settings, one replay per point, in parallel processes or on a Dask cluster."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qnpipe.cli.common import add_config_flags
from qnpipe.cli.figure_flags import add_figure_flags, figure_options
from qnpipe.cli.replay_cmd import add_export_flags, check_exports, log_outputs, write_exports
from qnpipe.errors import QnpipeError
from qnpipe.io.clobber import check_outputs
from qnpipe.io.figure import PLOT_FORMATS


def _base(args: argparse.Namespace) -> tuple[Any, Any, dict[str, str]]:
    """(config, base replay settings, the replay's own --set values) from --config, --set, --device, --predict."""
    from qnpipe import config
    from qnpipe.io.simssd import PROFILES
    from qnpipe.replay import CostModel, PredictorOpts
    from qnpipe.replay.sweep import Settings, resolve_key, split_settings

    if args.device not in PROFILES:
        raise QnpipeError(f"--device {args.device}: unknown, known: {', '.join(sorted(PROFILES))}")
    sets: dict[str, str] = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise QnpipeError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            sets[resolve_key(key)] = value.strip()
        except QnpipeError as e:
            raise QnpipeError(f"--set {item!r}: {e}") from None
    conf, own = split_settings(sets)
    cfg = config.load(args.config, overrides=conf)
    opts = PredictorOpts(train_frac=args.train_frac, recall=args.recall, seed=args.seed)
    base = Settings(device=PROFILES[args.device], cost=CostModel(), predictor=args.predict, opts=opts)
    # The replay's own --set values are checked with the grid (plan), as part of every point.
    return cfg, base, {f"{s}.{k}": v for s, d in own.items() for k, v in d.items()}


def table(result: Any, metric: str) -> Any:
    from rich.table import Table

    from qnpipe.replay.sweep import fmt_metric, fmt_value, table_metrics

    done = [p for p in result.points if p.error is None]
    names = [m for m in table_metrics(metric) if done and m in done[0].metrics]
    failed = f", {len(result.failed)} failed" if result.failed else ""
    t = Table(title=f"sweep of {result.log}: {len(result.points)} points{failed}")
    t.add_column("#", justify="right")
    for f in result.fields:
        t.add_column(f, justify="right")
    for m in names:
        t.add_column(m, justify="right", style="bold" if m == metric else None)
    for p in result.points:
        cells = [fmt_metric(m, p.metrics[m]) for m in names] if p.error is None else ["failed"] + ["-"] * (len(names) - 1)
        t.add_row(str(p.index), *(fmt_value(p.values[f]) for f in result.fields), *cells,
                  style="red" if p.error is not None else None)
    return t


class _Bar:
    """A transient rich progress bar of points on stderr (nothing when stderr is not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("points"),
                                     TimeElapsedColumn(), transient=True, console=Console(stderr=True))
            self.task = self.progress.add_task("sweep", total=total)
            self.progress.start()
        self.progress.update(self.task, completed=done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (the pool's workers are stopped on the way out) instead of dying on the spot."""


@contextmanager
def _sigterm_unwinds() -> Iterator[list[bool]]:
    """SIGTERM raises _Terminated in this (the main) thread for the duration; the list says whether it came."""
    came: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def on_term(signum: int, frame: Any) -> None:
        from qnpipe import hang_guard

        hang_guard.signalled(signum)  # the serial executor runs plug-ins in this process
        came.append(True)
        raise _Terminated

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, old)


def cmd_sweep(args: argparse.Namespace) -> int:
    with _sigterm_unwinds() as terminated:
        try:
            return _sweep(args)
        except BaseException:
            # the serial executor's replay may wrap it in trio's exception groups: the flag says it came
            if not terminated:
                raise
    print("qnpipe sweep: terminated (SIGTERM); the workers were stopped, nothing was written", file=sys.stderr)
    return 128 + signal.SIGTERM


def _outputs(args: argparse.Namespace, metric: str, points: list[Any]) -> list[tuple[str, Any]]:
    """Every file the sweep will write, named by its flag: -o, --csv, --parquet, the plots, the points' logs."""
    from qnpipe.replay.sweep_plot import file_name

    fields = list(points[0].values) if points else []
    plots = [Path(args.plot_dir) / file_name(metric, f, args.plot_format) for f in fields] if args.plot_dir else []
    return [("-o", args.output), ("--csv", args.csv), ("--parquet", args.parquet),
            *(("--plot-dir", p) for p in plots),
            *((f"grid point {p.index}: {what}", path) for p in points for what, path in log_outputs(p.cfg))]


def _sweep(args: argparse.Namespace) -> int:
    from qnpipe.replay.sweep import POINT_TIMEOUT_S, check_metric, parse_grid, plan, run, to_json, write_json

    if args.log is None:  # `qnpipe sweep --grid a=1,2 LOG`: the list of --grid took the log
        logs = [g for g in args.grid if "=" not in g]
        if len(logs) != 1:
            raise QnpipeError("give the LOG to sweep (qnpipe sweep LOG --grid KEY=V1,V2 ...)")
        args.log = logs[0]
        args.grid = [g for g in args.grid if g != args.log]
    if args.executor == "dask" and not args.scheduler:
        raise QnpipeError("--executor dask needs --scheduler ADDRESS (e.g. tcp://10.0.0.5:8786)")
    if args.scheduler and args.executor != "dask":
        raise QnpipeError("--scheduler is for --executor dask")
    if args.jobs is not None and args.jobs < 1:
        raise QnpipeError(f"--jobs {args.jobs}: must be >= 1")
    if args.point_timeout is not None and not args.point_timeout >= 0:
        raise QnpipeError(f"--point-timeout {args.point_timeout:g}: must be >= 0 seconds (0 = no limit)")
    if args.point_timeout is not None and args.executor != "processes":
        raise QnpipeError(f"--point-timeout is for --executor processes (a point in a process of its own can be "
                          f"killed), not {args.executor}")
    metric = check_metric(args.metric)
    if args.output:  # before the sweep, not after hours of it
        from qnpipe.trace import check_output_path

        check_output_path(args.output, "sweep JSON (-o)")
    if args.plot_dir and Path(args.plot_dir).exists() and not Path(args.plot_dir).is_dir():
        raise QnpipeError(f"--plot-dir {args.plot_dir}: exists and is not a directory")
    check_exports(args)
    opts = figure_options(args)  # a bad --size now, not after the sweep
    cfg, base, fixed = _base(args)
    points = plan(args.log, parse_grid(args.grid), cfg, base=base, fixed=fixed, equal_memory=args.equal_memory)
    check_outputs(_outputs(args, metric, points), [("LOG", args.log), ("--config", args.config)])
    wait = cfg.net.dask_connect_timeout_s
    if args.executor == "dask":
        print(f"qnpipe sweep: connecting to the Dask scheduler at {args.scheduler} (timeout {wait:g} s: "
              "net.dask_connect_timeout_s)", file=sys.stderr)
    bar = _Bar(enabled=sys.stderr.isatty() and not args.no_progress)
    try:
        result = run(args.log, points, executor=args.executor, jobs=args.jobs, scheduler=args.scheduler,
                     progress=bar, connect_timeout_s=wait,
                     point_timeout_s=POINT_TIMEOUT_S if args.point_timeout is None else args.point_timeout)
    finally:
        bar.close()
    if args.output:
        write_json(result, args.output)
    if args.plot_dir:
        from qnpipe.replay.sweep_plot import plot

        plot(result, metric, args.plot_dir, fmt=args.plot_format, opts=opts)
    if args.csv or args.parquet:
        from qnpipe.replay.export import config_columns
        from qnpipe.replay.sweep import replay_keys, resolve_key

        own = set(replay_keys())
        keys = [k for k in (resolve_key(item.partition("=")[0]) for item in args.sets) if k not in own]
        write_exports(args, result.rows(config_columns(cfg, keys)))
    if args.json:
        print(to_json(result).decode())
    else:
        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 200).print(table(result, metric))
    if result.failed:
        print(f"qnpipe sweep: {len(result.failed)} of {len(result.points)} points failed:", file=sys.stderr)
        for p in result.points:
            if p.error is not None:
                print(f"  {p.error}", file=sys.stderr)
        return 1
    return 0


def register(sub: Any, fmt: Any) -> None:
    s = sub.add_parser("sweep", help="replay a log at every point of a grid of settings (parallel, or on Dask)",
                       formatter_class=fmt,
                       description="Replay a log (qnpipe replay) at every point of the cartesian product of the\n"
                       "--grid fields, in parallel worker processes (--jobs, default one per core) or on a\n"
                       "Dask cluster (--executor dask --scheduler ADDRESS), and print a table of the points\n"
                       "with their headline metrics. A grid field is any config field (pool.expert_slots, or\n"
                       "a short name such as expert_slots when it names one field) or a replay setting\n"
                       "(cost.*, device.*, replay.record_nbytes, replay.predictor, replay.step_order and the\n"
                       "predictor's replay.train_frac, replay.recall, replay.seed). Every point is checked\n"
                       "before any replay runs: an unknown field or a bad value fails at once, naming it.\n"
                       "Values are comma-separated, or ';'-separated when a value holds commas.\n"
                       "Results are in grid order and the same whatever the executor (docs/replay.md).\n"
                       "A point whose replay fails is reported (its row says failed, its JSON point holds the\n"
                       "error) and the others still run; the exit status is then 1. A point still running after\n"
                       "--point-timeout seconds (default one hour) is killed and fails so. SIGTERM stops the workers.",
                       epilog="examples:\n"
                       "  qnpipe sweep run.qtrace --grid pool.expert_slots=4,8,16 --grid pool.evict_policy=lru,lfu\n"
                       "  qnpipe sweep run.qtrace --grid expert_slots=8,16 replay.predictor=none,previous \\\n"
                       "      --metric hit_rate --plot-dir plots/ --plot-format pdf -o sweep.json --csv sweep.csv\n"
                       "  qnpipe sweep run.qtrace --equal-memory --set expert_slots=4 --set side_region_slots=3 \\\n"
                       "      --grid replay.predictor=none,previous,oracle pool.prefetch_into=side,main --metric hit_rate\n"
                       "  qnpipe sweep synth.qtrace --equal-memory --set replay.record_nbytes=1048576 --set expert_slots=4 \\\n"
                       "      --set side_region_slots=2 --grid replay.predictor=none,transition replay.train_frac=0.2,0.5\n"
                       "  qnpipe sweep routes.qtrace --set replay.record_nbytes=1048576 \\\n"
                       "      --grid device.queue_depth=1,2,4,8 --executor dask --scheduler tcp://10.0.0.5:8786")
    s.add_argument("log", metavar="LOG", nargs="?",
                   help="event or routing log (qnpipe generate --trace), docs/trace-format.md")
    s.add_argument("--grid", metavar="KEY=V1,V2", nargs="+", action="extend", default=[], required=True,
                   help="a swept field and its values (repeatable; several may follow one --grid)")
    s.add_argument("--metric", default="tok_s", metavar="NAME",
                   help="the metric the plots show and the table emphasises: tok_s (default), hit_rate, "
                   "belady_hit_rate, misses, stall_s_per_token, bytes_per_token, device_utilisation, ...")
    s.add_argument("-o", "--output", metavar="FILE", help="write the whole sweep as JSON to FILE (atomically)")
    s.add_argument("--plot-dir", metavar="DIR", help="write a plot of the metric against each swept field to DIR")
    s.add_argument("--plot-format", choices=PLOT_FORMATS, default="png",
                   help="the plots' file format (default %(default)s; pdf and svg are vector graphics)")
    add_figure_flags(s)
    add_export_flags(s)
    s.add_argument("--jobs", type=int, metavar="N", help="worker processes (default: the machine's cores)")
    s.add_argument("--executor", choices=["processes", "dask", "serial"], default="processes",
                   help="processes (default): local worker processes; dask: a dask.distributed cluster "
                   "(needs --scheduler); serial: one after another in this process")
    s.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler address, e.g. tcp://10.0.0.5:8786")
    s.add_argument("--point-timeout", type=float, metavar="S",
                   help="--executor processes: a point still replaying S seconds after it started is killed and "
                   "reported as failed, the others go on (default 3600, qnpipe.replay.sweep.POINT_TIMEOUT_S; "
                   "0 = no limit)")
    s.add_argument("--device", default="apple-m5-internal", metavar="NAME",
                   help="built-in device profile the device.* settings start from (default %(default)s)")
    s.add_argument("--predict", default="none", metavar="NAME",
                   help="the replay's predictor at every point unless swept as replay.predictor "
                   "(none = demand only, default; previous: see qnpipe replay --help)")
    s.add_argument("--train-frac", type=float, default=0.0, metavar="F",
                   help="the log's first F of steps train the predictor and are not replayed, at every point unless "
                   "swept as replay.train_frac (default 0)")
    s.add_argument("--recall", type=float, default=1.0, metavar="R",
                   help="oracle: each true expert is hinted with probability R, unless swept as replay.recall (default 1)")
    s.add_argument("--seed", type=int, default=0, help="oracle: seed of its draws, unless swept as replay.seed (default 0)")
    s.add_argument("--equal-memory", action="store_true",
                   help="give each demand-only point (predictor none) the side region's slots as resident slots "
                   "(pool.expert_slots + pool.side_region_slots), the memory its prefetch points have; the "
                   "table's slots_per_layer and memory_bytes columns show it")
    s.add_argument("--json", action="store_true", help="print the whole sweep as JSON instead of the table")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(s, prefill=False, example="pool.evict_policy=lru")
    s.set_defaults(func=cmd_sweep)
