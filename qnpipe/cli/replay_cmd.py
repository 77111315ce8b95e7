"""`qnpipe replay`: an event log through the real actors on a simulated SSD, in virtual time."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.cli.common import add_config_flags, config_overrides, stop_on_signals
from qnpipe.cli.figure_flags import add_figure_flags, figure_options
from qnpipe.errors import QnpipeError
from qnpipe.io.clobber import check_outputs

# qnpipe.replay.PREDICTORS, spelled out: importing qnpipe.replay here would load MLX for every command.
PREDICTORS = ("none", "previous", "recorded", "transition", "oracle")
DRIVERS = ("fast", "actors")  # qnpipe.replay.DRIVERS
_REPLAY_KEYS = {"cost.per_layer_s", "cost.per_token_s", "cost.per_step_s", "cost.read_hop_s", "cost.per_miss_s",
                "device.bandwidth_bytes_per_s", "device.latency_s", "device.per_mb_latency_s", "device.queue_depth",
                "replay.record_nbytes", "replay.step_order"}


def cmd_replay(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.io.device_file import device_names, named_profile
    from qnpipe.io.simssd import DeviceProfile
    from qnpipe.replay import CostModel, PredictorOpts, describe, replay, setting_value, to_json
    from qnpipe.replay.cost_fit import load_cost

    if args.mrc:
        return _mrc(args)
    if args.plot or args.mrc_layers:
        raise QnpipeError("--plot and --mrc-layers draw miss-ratio curves: give --mrc")
    if args.device not in device_names():
        raise QnpipeError(f"--device {args.device}: unknown, known: {', '.join(device_names())}")
    own: dict[str, dict[str, Any]] = {"cost": {}, "device": {}, "replay": {}}
    rest = []
    for item in args.sets:  # cost.*, device.* and replay.* are the replay's own; the rest is the config
        key, sep, value = item.partition("=")
        if sep and key.strip() in _REPLAY_KEYS:
            section, _, name = key.strip().partition(".")
            own[section][name] = setting_value(key.strip(), value)  # the ranges: replay checks them
        else:
            rest.append(item)
    args.sets = rest
    check_exports(args)  # before the replay, not after it
    cfg = config.load(args.config, overrides=config_overrides(args))
    check_outputs([("--csv", args.csv), ("--parquet", args.parquet), *log_outputs(cfg)], replay_inputs(args, cfg))
    fitted = msgspec.to_builtins(load_cost(args.cost).cost) if args.cost else {}
    # The values were typed above, so these convert; replay checks each against its bounds, naming it.
    cost = msgspec.convert({**fitted, **own["cost"]}, CostModel, strict=False)
    base = msgspec.to_builtins(named_profile(args.device, cfg.read.device_profile_path))
    device = msgspec.convert({**base, **own["device"]}, DeviceProfile, strict=False)
    nbytes = own["replay"].get("record_nbytes")
    order = own["replay"].get("step_order", "id")
    opts = PredictorOpts(train_frac=args.train_frac, train_log=args.train_log or "", recall=args.recall, seed=args.seed)
    # SIGTERM unwinds (a plug-in's sleep included) and says so; Ctrl-C is trio's where the actors driver runs.
    with stop_on_signals(args, ctrl_c=False):
        report = replay(args.log, cfg, device_profile=device, cost=cost, record_nbytes=nbytes,
                        predictor=args.predict, opts=opts, driver=args.driver, step_order=order)
    if args.csv or args.parquet:
        from qnpipe.config import override_path
        from qnpipe.replay.export import config_columns

        write_exports(args, report.rows(config_columns(cfg, [override_path(k) for k in config_overrides(args)])))
    print(to_json(report).decode() if args.json else describe(report))
    return 0


def check_exports(args: argparse.Namespace) -> None:
    """--csv and --parquet writable, and pyarrow there for --parquet: checked before any replay runs."""
    from qnpipe.trace import check_output_path

    if args.csv:
        check_output_path(args.csv, "CSV (--csv)")
    if args.parquet:
        from qnpipe.replay.export import pyarrow

        pyarrow()
        check_output_path(args.parquet, "Parquet file (--parquet)")


def replay_inputs(args: argparse.Namespace, cfg: Any) -> list[tuple[str, Any]]:
    """The files a replay reads, named by their flag or setting, for qnpipe.io.clobber.check_outputs."""
    measured = getattr(args, "device", None) == "measured"
    return [("LOG", args.log), ("--config", args.config), ("--train-log", getattr(args, "train_log", None)),
            ("--cost", getattr(args, "cost", None)),
            ("read.device_profile_path", cfg.read.device_profile_path if measured else None),
            ("pool.capacity_profile_path", cfg.pool.capacity_profile_path)]


def log_outputs(cfg: Any) -> list[tuple[str, Any]]:
    """The logs a replay of `cfg` writes (trace.event_log_path, the routing log), named by their setting."""
    return [("trace.event_log_path", cfg.trace.event_log_path),
            ("trace.route_trace_path", cfg.trace.route_trace_path if cfg.trace.route_trace else None)]


def write_exports(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from qnpipe.replay.export import write_csv, write_parquet

    if args.csv:
        write_csv(rows, args.csv)
    if args.parquet:
        write_parquet(rows, args.parquet)


def add_export_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--csv", metavar="FILE",
                   help="also write the results as a tidy CSV: one row per point x layer x metric, the settings as "
                        "columns, layer 'all' for the whole run (docs/replay.md, Tidy tables)")
    p.add_argument("--parquet", metavar="FILE",
                   help="the same rows as a Parquet file (needs pyarrow: pip install 'qnpipe[parquet]')")


def _mrc(args: argparse.Namespace) -> int:
    """`--mrc`: the LRU and Belady hit rate at every capacity, a CSV and a plot (qnpipe.replay.mrc)."""
    import time

    from qnpipe.replay.mrc import POLICIES, miss_ratio_curves
    from qnpipe.replay.mrc_export import plot, summary, write_csv

    if args.predict != "none" or args.train_frac or args.train_log:
        raise QnpipeError("--mrc: demand caching only (no --predict, --train-frac or --train-log)")
    policies = [p.strip() for p in args.mrc_policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise QnpipeError(f"--mrc-policies {args.mrc_policies}: a comma-separated subset of {', '.join(POLICIES)}")
    try:
        layers = [int(x) for x in args.mrc_layers.split(",") if x.strip()] if args.mrc_layers else []
    except ValueError:
        raise QnpipeError(f"--mrc-layers {args.mrc_layers}: comma-separated layer numbers") from None
    stem = Path(args.log).name.removesuffix(".gz").rsplit(".", 1)[0] or "log"
    check_exports(args)
    csv_path = Path(args.csv or f"{stem}.mrc.csv")
    png_path = Path(args.plot) if args.plot else None  # a plot only when asked for
    opts = figure_options(args)  # a bad --size before the curves, not after them
    check_outputs([("--csv" if args.csv else "the curves' CSV", csv_path), ("--plot", png_path),
                   ("--parquet", args.parquet)], [("LOG", args.log), ("--config", args.config)])
    for p in (csv_path, png_path):
        if p is not None and p.is_dir():
            raise QnpipeError(f"{p}: is a directory, give a file name")
    t0 = time.perf_counter()
    result = miss_ratio_curves(args.log, policies=policies)
    took = time.perf_counter() - t0
    routed = {c.layer for c in result.curves}
    if missing := [x for x in layers if x not in routed]:
        raise QnpipeError(f"--mrc-layers: layers {missing} are not routed in {args.log} "
                          f"(its MoE layers with routes: {sorted(x for x in routed if isinstance(x, int))})")
    write_csv(result, csv_path)
    if args.parquet:
        from qnpipe.replay.export import write_parquet

        write_parquet(result.rows(), args.parquet)
    if png_path is not None:
        plot(result, png_path, layers=layers, opts=opts)
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        print(summary(result))
        print(f"  {took:.2f} s; wrote {csv_path} ({len(result.rows())} rows)" + (f" and {png_path}" if png_path else ""))
    return 0


def register(sub: Any, fmt: Any) -> None:
    r = sub.add_parser("replay", help="replay an event log on a simulated SSD in virtual time (what-if)",
                       formatter_class=fmt,
                       description="Replay the routes of a log written by `qnpipe generate --trace FILE` through the real\n"
                       "pool and read scheduler, with modelled compute (cost.*) and a simulated device\n"
                       "(--device, device.*), in virtual time: no model, same report on every run.\n"
                       "Reports steps/s, hit rate, misses by cause, bytes and stall per step, device\n"
                       "utilisation, and per layer the hit rate beside Belady's optimum at that capacity.\n"
                       "Replay settings: cost.per_layer_s, cost.per_token_s, cost.per_step_s, cost.read_hop_s,\n"
                       "cost.per_miss_s\n"
                       "(over --cost), device.bandwidth_bytes_per_s, device.latency_s, device.per_mb_latency_s,\n"
                       "device.queue_depth (over --device), replay.record_nbytes, replay.step_order (id: a step's\n"
                       "experts served in ascending id, the default, as the live forward does; router: as the router\n"
                       "names them);\n"
                       "any other --set is a config setting (pool.expert_slots, pool.evict_policy, read.workers).\n"
                       "Without pool.expert_slots (or a capacity profile) a log that recorded its slots is replayed at\n"
                       "them, and the report says so. The eviction policy is pool.evict_policy (lfu by default; --mrc\n"
                       "is LRU); the report names it.\n"
                       "\n"
                       "--mrc instead gives miss-ratio curves: per layer and over all layers, the demand hit\n"
                       "rate of LRU and of Belady's optimum at EVERY capacity from top-k (the fewest slots the\n"
                       "pool takes) to the expert count, in one pass over the log, under the pool's own rules\n"
                       "(a step's experts at a layer are held together). The same numbers as a replay with\n"
                       "--set pool.expert_slots=C --set pool.evict_policy=lru (and its Belady column) at each C,\n"
                       "without the device or timing. Writes a CSV (--csv) and a PNG (--plot); docs/replay.md.",
                       epilog="examples:\n"
                       "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 32 --trace run.qtrace\n"
                       "  qnpipe replay run.qtrace --set pool.expert_slots=16 --set pool.evict_policy=lru\n"
                       "  qnpipe replay run.qtrace --json --set device.bandwidth_bytes_per_s=3e9 "
                       "--set cost.per_layer_s=0.004\n"
                       "  qnpipe trace fit-cost run.qtrace -o run.cost.json && qnpipe bench io\n"
                       "  qnpipe replay run.qtrace --cost run.cost.json --device measured\n"
                       "  qnpipe replay run.qtrace --predict recorded --set pool.side_region_slots=8\n"
                       "  qnpipe replay synth.qtrace --predict transition --train-frac 0.2 --set replay.record_nbytes=1700000\n"
                       "  qnpipe replay synth.qtrace --predict oracle --recall 0.8 --seed 1 --set replay.record_nbytes=1700000\n"
                       "  qnpipe replay run.qtrace --set pool.expert_slots=16 --csv run.csv\n"
                       "  qnpipe replay run.qtrace --mrc                       run.mrc.csv here\n"
                       "  qnpipe replay run.qtrace --mrc --csv run-mrc.csv --plot run-mrc.pdf --mrc-layers 0,23")
    r.add_argument("log", metavar="LOG", help="event log (qnpipe generate --trace), docs/trace-format.md")
    r.add_argument("--device", default="apple-m5-internal", metavar="NAME",
                   help="device profile the device.* settings start from: apple-m5-internal (default) or measured "
                   "(the file `qnpipe bench io` saved at read.device_profile_path)")
    r.add_argument("--cost", metavar="COST",
                   help="cost file of `qnpipe trace fit-cost` the cost.* settings start from (default: cost.* alone)")
    r.add_argument("--predict", choices=PREDICTORS, default="none",
                   help="none = demand reads only (default); recorded = the log's own predict.candidates; "
                   "previous = the next layer routes as the previous token did; transition = a layer-to-layer "
                   "table learned from --train-frac or --train-log; oracle = the true next-layer experts at "
                   "--recall. Any but none turns predict.cross_layer_prefetch on (docs/replay.md)")
    r.add_argument("--train-frac", type=float, default=0.0, metavar="F",
                   help="the log's first F of steps train the predictor and are not replayed (default 0)")
    r.add_argument("--train-log", metavar="LOG", help="transition: learn the table from this log instead")
    r.add_argument("--recall", type=float, default=1.0, metavar="R",
                   help="oracle: each true expert is hinted with probability R (default 1)")
    r.add_argument("--seed", type=int, default=0, help="oracle: seed of its draws (default 0)")
    r.add_argument("--driver", choices=DRIVERS, default="fast",
                   help="fast = the pipeline's decision cores on a plain event loop (default); actors = the live "
                   "trio actors on a virtual clock, the reference: the same report byte for byte, slower")
    r.add_argument("--json", action="store_true", help="print the report (with --mrc: the curves) as one JSON object")
    r.add_argument("--mrc", action="store_true",
                   help="miss-ratio curves instead of one replay: LRU and Belady hit rate at every capacity "
                   "(top-k .. expert count), per layer and in total; writes --csv (one row per policy x layer x "
                   "capacity: policy,layer,capacity,hits,requests,hit_rate, layer 'all' = the total; default "
                   "<log name>.mrc.csv here) and, when given, --plot; prints a summary")
    r.add_argument("--plot", metavar="FILE", help="--mrc: also draw the miss-ratio curves to FILE (.png, .pdf or .svg "
                   "by its suffix; none by default)")
    add_figure_flags(r)
    r.add_argument("--mrc-policies", default="lru,belady", metavar="P,P",
                   help="--mrc: which curves, of lru and belady (default both)")
    r.add_argument("--mrc-layers", metavar="L,L", help="--mrc: also plot these layers' own curves (thin lines)")
    add_export_flags(r)
    add_config_flags(r, prefill=False, example="pool.expert_slots=16")
    r.set_defaults(func=cmd_replay)
