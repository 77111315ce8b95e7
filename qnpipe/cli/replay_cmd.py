"""`qnpipe replay`: an event log through the real actors on a simulated SSD, in virtual time."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from qnpipe.cli.common import add_config_flags, config_overrides
from qnpipe.errors import QnpipeError

_REPLAY_KEYS = {"cost.per_layer_s", "cost.per_token_s", "cost.per_step_s", "cost.read_hop_s",
                "device.bandwidth_bytes_per_s", "device.latency_s", "device.per_mb_latency_s", "device.queue_depth",
                "replay.record_nbytes"}


def cmd_replay(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.cost_fit import load_cost
    from qnpipe.io.device_file import device_names, named_profile
    from qnpipe.io.simssd import DeviceProfile
    from qnpipe.replay import CostModel, describe, replay, to_json

    if args.device not in device_names():
        raise QnpipeError(f"--device {args.device}: unknown, known: {', '.join(device_names())}")
    own: dict[str, dict[str, str]] = {"cost": {}, "device": {}, "replay": {}}
    rest = []
    for item in args.sets:  # cost.*, device.* and replay.* are the replay's own; the rest is the config
        key, sep, value = item.partition("=")
        if sep and key.strip() in _REPLAY_KEYS:
            section, _, name = key.strip().partition(".")
            own[section][name] = value.strip()
        else:
            rest.append(item)
    args.sets = rest
    cfg = config.load(args.config, overrides=config_overrides(args))
    fitted = msgspec.to_builtins(load_cost(args.cost).cost) if args.cost else {}
    try:
        cost = msgspec.convert({**fitted, **own["cost"]}, CostModel, strict=False)
        base = msgspec.to_builtins(named_profile(args.device, cfg.read.device_profile_path))
        device = msgspec.convert({**base, **own["device"]}, DeviceProfile, strict=False)
        nbytes = int(own["replay"]["record_nbytes"]) if "record_nbytes" in own["replay"] else None
    except (msgspec.ValidationError, ValueError) as e:
        raise QnpipeError(f"--set: {e}") from None
    report = replay(args.log, cfg, device_profile=device, cost=cost, record_nbytes=nbytes, predictor=args.predict)
    print(to_json(report).decode() if args.json else describe(report))
    return 0


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
                       "  qnpipe replay run.qtrace --cost run.cost.json --device measured")
    r.add_argument("log", metavar="LOG", help="event log (qnpipe generate --trace), docs/trace-format.md")
    r.add_argument("--device", default="apple-m5-internal", metavar="NAME",
                   help="device profile the device.* settings start from: apple-m5-internal (default) or measured "
                   "(the file `qnpipe bench io` saved at read.device_profile_path)")
    r.add_argument("--cost", metavar="COST",
                   help="cost file of `qnpipe trace fit-cost` the cost.* settings start from (default: cost.* alone)")
    r.add_argument("--predict", choices=["none", "previous"], default="none",
                   help="none = demand reads only (default); previous = model-free prefetch: each MoE layer "
                   "hints that the next routes as the previous token did (turns predict.cross_layer_prefetch on)")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_config_flags(r, prefill=False, example="pool.expert_slots=16")
    r.set_defaults(func=cmd_replay)
