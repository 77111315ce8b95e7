"""`qnpipe trace fit-cost LOG -o COST`: the replay's compute cost model, fitted from a live run's event log."""

from __future__ import annotations

import argparse
from typing import Any

from qnpipe.cli.common import add_config_flags, config_overrides


def cmd_fit_cost(args: argparse.Namespace) -> int:
    import msgspec

    from qnpipe import config
    from qnpipe.io.clobber import check_outputs
    from qnpipe.io.device_file import named_profile
    from qnpipe.replay.cost_fit import fit_cost, save_cost
    from qnpipe.trace import check_output_path

    check_output_path(args.output, "cost file (-o)")
    cfg = config.load(args.config, overrides=config_overrides(args))
    measured = cfg.read.device_profile_path if args.device == "measured" else None
    check_outputs([("-o", args.output)], [*(("LOG", p) for p in args.log), ("--config", args.config),
                                          ("read.device_profile_path", measured)])
    device = named_profile(args.device, cfg.read.device_profile_path) if args.device else None
    fit = fit_cost(args.log, device, per_layer=args.per_layer, per_miss=args.per_miss)
    save_cost(args.output, fit)
    if args.json:
        print(msgspec.json.encode(fit).decode())
    else:
        c = fit.cost
        print(f"{args.output}: per_layer_s={c.per_layer_s:.6g} per_token_s={c.per_token_s:.6g} "
              f"per_step_s={c.per_step_s:.6g} read_hop_s={c.read_hop_s:.6g} per_miss_s={c.per_miss_s:.6g} (fitted {', '.join(fit.fitted)} over {fit.samples} gaps of "
              f"{fit.steps} steps; rms residual {fit.rms_residual_s * 1e3:.3f} ms of a mean gap "
              f"{fit.mean_gap_s * 1e3:.3f} ms)")
        if c.layer_table:
            print("  per layer: " + ", ".join(f"{la}: {v * 1e3:.3f} ms" for la, v in c.layer_table.items()))
    return 0


def register(tsub: Any, fmt: Any) -> None:
    f = tsub.add_parser("fit-cost", help="fit the replay's compute cost model from a live run's event log",
                        formatter_class=fmt,
                        description="Fit per_layer_s, per_token_s and per_step_s (docs/replay.md, cost model) by least\n"
                        "squares to the forward's time between one layer part's pool.acquire and the next,\n"
                        "less the part's wait when it had misses (the device: the replay models it); with\n"
                        "--device, read_hop_s: the miss path's time beyond that device profile. Writes\n"
                        "the cost file (JSON: the CostModel, the terms fitted, the rms residual) for\n"
                        "`qnpipe replay LOG --cost COST`.",
                        epilog="examples:\n"
                        "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 32 --set pool.expert_slots=8 --trace run.qtrace\n"
                        "  qnpipe trace fit-cost run.qtrace -o run.cost.json --device measured\n"
                        "  qnpipe trace fit-cost run.qtrace -o run.cost.json --per-layer --json\n"
                        "  qnpipe trace fit-cost a.qtrace b.qtrace -o run.cost.json --device measured --per-miss\n"
                        "  qnpipe replay run.qtrace --cost run.cost.json --device measured")
    f.add_argument("log", metavar="LOG", nargs="+",
                   help="event log(s) of streamed live runs (qnpipe generate --trace); several: one fit of all their gaps")
    f.add_argument("-o", "--output", required=True, metavar="COST", help="cost file to write (JSON)")
    f.add_argument("--device", metavar="NAME",
                   help="also fit read_hop_s (the live miss path's time beyond this device profile: measured, "
                   "apple-m5-internal); give the profile the replay will use")
    f.add_argument("--per-layer", action="store_true",
                   help="one per_layer_s per MoE layer (cost layer_table) instead of one for all")
    f.add_argument("--per-miss", action="store_true",
                   help="also fit per_miss_s: the compute a part's misses cost beyond their wait")
    f.add_argument("--json", action="store_true", help="print the cost file's contents as one JSON object")
    add_config_flags(f, prefill=False, example="read.device_profile_path=nvme.json")
    f.set_defaults(func=cmd_fit_cost)
