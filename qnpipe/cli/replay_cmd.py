"""`qnpipe replay`: an event log through the real actors on a simulated SSD, in virtual time."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from qnpipe.cli.common import add_config_flags, config_overrides
from qnpipe.errors import QnpipeError

# qnpipe.replay.PREDICTORS, spelled out: importing qnpipe.replay here would load MLX for every command.
PREDICTORS = ("none", "previous", "recorded", "transition", "oracle")
DRIVERS = ("fast", "actors")  # qnpipe.replay.DRIVERS
_REPLAY_KEYS = {"cost.per_layer_s", "cost.per_token_s", "cost.per_step_s", "cost.read_hop_s",
                "device.bandwidth_bytes_per_s", "device.latency_s", "device.per_mb_latency_s", "device.queue_depth",
                "replay.record_nbytes"}


def cmd_replay(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.io.device_file import device_names, named_profile
    from qnpipe.io.simssd import DeviceProfile
    from qnpipe.replay import CostModel, PredictorOpts, describe, replay, setting_value, to_json
    from qnpipe.replay.cost_fit import load_cost

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
    fitted = msgspec.to_builtins(load_cost(args.cost).cost) if args.cost else {}
    # The values were typed above, so these convert; replay checks each against its bounds, naming it.
    cost = msgspec.convert({**fitted, **own["cost"]}, CostModel, strict=False)
    base = msgspec.to_builtins(named_profile(args.device, cfg.read.device_profile_path))
    device = msgspec.convert({**base, **own["device"]}, DeviceProfile, strict=False)
    nbytes = own["replay"].get("record_nbytes")
    opts = PredictorOpts(train_frac=args.train_frac, train_log=args.train_log or "", recall=args.recall, seed=args.seed)
    report = replay(args.log, cfg, device_profile=device, cost=cost, record_nbytes=nbytes, predictor=args.predict,
                    opts=opts, driver=args.driver)
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


def register(sub: Any, fmt: Any) -> None:
    r = sub.add_parser("replay", help="replay an event log on a simulated SSD in virtual time (what-if)",
                       formatter_class=fmt,
                       description="Replay the routes of a log written by `qnpipe generate --trace FILE` through the real\n"
                       "pool and read scheduler, with modelled compute (cost.*) and a simulated device\n"
                       "(--device, device.*), in virtual time: no model, same report on every run.\n"
                       "Reports steps/s, hit rate, misses by cause, bytes and stall per step, device\n"
                       "utilisation, and per layer the hit rate beside Belady's optimum at that capacity.\n"
                       "Replay settings: cost.per_layer_s, cost.per_token_s, cost.per_step_s, cost.read_hop_s\n"
                       "(over --cost), device.bandwidth_bytes_per_s, device.latency_s, device.per_mb_latency_s,\n"
                       "device.queue_depth (over --device), replay.record_nbytes;\n"
                       "any other --set is a config setting (pool.expert_slots, pool.evict_policy, read.workers).",
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
                       "  qnpipe replay run.qtrace --set pool.expert_slots=16 --csv run.csv")
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
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_export_flags(r)
    add_config_flags(r, prefill=False, example="pool.expert_slots=16")
    r.set_defaults(func=cmd_replay)
