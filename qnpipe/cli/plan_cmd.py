"""`qnpipe plan`: the fastest configuration of a model that fits a memory budget (docs/plan.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qnpipe.cli.common import add_config_flags, config_overrides, stop_on_signals
from qnpipe.cli.figure_flags import add_figure_flags, figure_options
from qnpipe.errors import QnpipeError

PLOT_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25)  # --plot: budgets between the smallest that fits and 1.25 x --memory


def cmd_plan(args: argparse.Namespace) -> int:
    with stop_on_signals(args):  # SIGTERM unwinds the planning: its temporary files are removed
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.plan import fmt_bytes, make_plans, minimum_budget, parse_memory, save_plan
    from qnpipe.plan.make import resolve_model

    model = args.shape or args.model_dir
    if model is None:
        raise QnpipeError("give MODEL_DIR (a `qnpipe convert` output) or --shape CONFIG_JSON")
    memory = parse_memory(args.memory)
    headroom = parse_memory(args.headroom, key="--headroom") if args.headroom not in ("0", "") else 0
    cfg = config.load(args.config, overrides=config_overrides(args))
    if args.device is None:
        args.device = cfg.plan.device
    if args.log is None:
        args.log = recorded_log(args, cfg)
    check_plan_outputs(args, cfg)
    facts = resolve_model(Path(model), cfg, args.bits)
    if args.ranks is not None:
        return plan_ranks(args, cfg, facts, memory, headroom)
    budgets = [memory]
    opts = figure_options(args)  # a bad --size now, not after the plans
    if args.plot:
        least = minimum_budget(facts, cfg, context=args.context, headroom_bytes=headroom)
        budgets = sorted({max(least, int(least + (memory - least) * f)) for f in PLOT_FRACTIONS} | {memory})
    say = (lambda s: print(s, file=sys.stderr)) if not args.quiet else None
    if args.cost is None and cfg.plan.cost_path:
        args.cost = cfg.plan.cost_path
    plans = make_plans(facts, budgets, log=args.log, device=args.device, cost=args.cost, context=args.context,
                       cfg=cfg, headroom_bytes=headroom, window_layer_steps=args.window_layer_steps,
                       synth_path=Path(f"{args.output}.synth.qtrace") if args.output and not args.log else None,
                       say=say)
    plan = plans[budgets.index(memory)]
    if args.output:
        save_plan(args.output, plan)
    if args.plot:
        from qnpipe.plan.plot import plot_plans

        plot_plans(plans, plan, args.plot, opts)
    print(describe(plan, fmt_bytes))
    return 0


def recorded_log(args: argparse.Namespace, cfg: Any) -> str | None:
    """`plan.log`, else the log a run of MODEL_DIR recorded (`<expert dir>/trace.qtrace`, what `generate
    --memory` plans from: qnpipe.plan.startup.find_log), else None (a synthetic log)."""
    from qnpipe.config import with_overrides
    from qnpipe.plan.startup import find_log

    if args.shape or not args.model_dir:
        return cfg.plan.log or None
    at = cfg if cfg.model.model_dir == args.model_dir else with_overrides(cfg, {"model.model_dir": args.model_dir})
    found = find_log(at)
    return str(found) if found is not None else None


def rank_output(out: Path, rank: int) -> Path:
    """Rank `rank`'s plan file of `-o out` (named as a distributed run names a rank's files: qnpipe.live.parallel.join)."""
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def check_plan_outputs(args: argparse.Namespace, cfg: Any) -> None:
    """-o, its ranks' files, the synthetic log beside it and --plot are none of the files the plan reads."""
    from qnpipe.config.user_dirs import device_profile_path
    from qnpipe.io.clobber import check_outputs

    out = Path(args.output) if args.output else None
    plans = [("-o", out)] if args.ranks is None else [("-o", rank_output(out, r)) for r in range(max(args.ranks, 0))
                                                      if out is not None]
    synth = ("the synthetic log beside -o", Path(f"{out}.synth.qtrace") if out is not None and not args.log else None)
    device = args.device
    inputs = [("--log", args.log), ("--cost", args.cost), ("--shape", args.shape), ("--config", args.config),
              ("--device", device if Path(device).is_file() else None),
              ("read.device_profile_path", device_profile_path(cfg) if device == "measured" else None)]
    check_outputs([*plans, synth, ("--plot", args.plot)], inputs,
                  models=[("MODEL_DIR", args.model_dir if not args.shape else None)])


def plan_ranks(args: argparse.Namespace, cfg: Any, facts: Any, memory: int, headroom: int) -> int:
    """`--ranks N`: the split by the memory account and each rank's plan in `memory` (docs/distributed.md)."""
    from qnpipe.plan import fmt_bytes, make_plans, save_plan
    from qnpipe.plan.ranks import check_ranks, layer_weights, memory_split

    if args.shape or args.plot:
        raise QnpipeError(f"--ranks {args.ranks}: plans a `qnpipe convert` directory's ranks, without "
                          f"{'--shape' if args.shape else '--plot'}")
    if args.ranks < 1:
        raise QnpipeError(f"--ranks {args.ranks}: must be at least 1")
    weights = layer_weights(facts, cfg)
    shares = memory_split(facts, cfg, weights, args.ranks, context=args.context)
    check_ranks(facts, cfg, weights, shares, [memory] * len(shares), context=args.context, headroom_bytes=headroom)
    say = (lambda s: print(s, file=sys.stderr)) if not args.quiet else None
    out = Path(args.output) if args.output else None
    plans = []
    for share in shares:
        [plan] = make_plans(facts, [memory], log=args.log, device=args.device, cost=args.cost, context=args.context,
                            cfg=cfg, headroom_bytes=headroom, window_layer_steps=args.window_layer_steps,
                            synth_path=Path(f"{out}.synth.qtrace") if out and not args.log else None, say=say,
                            share=share)
        if out is not None:
            save_plan(rank_output(out, share.rank), plan)
        print(describe(plan, fmt_bytes))
        plans.append(plan)
    # One sequence visits the ranks in turn: a token takes the sum of their times (hand-off not counted).
    secs = [1 / p.predicted_tok_s if p.predicted_tok_s else float("inf") for p in plans]
    print(f"pipeline of {len(plans)} ranks in {fmt_bytes(memory)} each: predicted {1 / sum(secs):.3f} tok/s "
          f"(1 / the sum of the ranks' seconds per token: {' + '.join(f'{1e3 * x:.3f}' for x in secs)} ms; "
          f"the hand-off between ranks not counted)")
    return 0


def describe(plan: Any, fmt_bytes: Any) -> str:
    caps = sorted(plan.capacities.values())
    who = f" {plan.share.label} of {plan.share.ranks}" if plan.share is not None else ""
    lines = [f"plan for {plan.model}{who} in {fmt_bytes(plan.memory_bytes)} (context {plan.context} tokens):",
             *(f"  note: {n}" for n in plan.notes),
             f"  resident slots per layer: {caps[0]}..{caps[-1]} (median {caps[len(caps) // 2]}, "
             f"{sum(caps)} in all); side region {plan.side_region_slots} per layer",
             f"  eviction {plan.evict_policy}; prefetch {'on, into ' + plan.prefetch_into if plan.prefetch else 'off'}; "
             f"autopin {'on' if plan.autopin else 'off'}",
             f"  predicted: {plan.predicted_tok_s:.3f} tok/s, hit rate {plan.predicted_hit_rate:.4f}, "
             f"{plan.predicted_bytes_per_token / 2**20:.2f} MiB read per token",
             f"  (the fast replay of {plan.log} steps {plan.replay_first_step}..{plan.log_steps - 1} on "
             f"{plan.device_name}; planned in {plan.plan_s:.1f} s)",
             f"  device profile: {plan.device_name} ({profile_words(plan.device)}); cost model: {cost_words(plan.cost)}",
             "  candidates (equal memory):",
             *(f"    {c.name:<34} {c.tok_s:9.3f} tok/s  hit {c.hit_rate:.4f}  (whole log: LRU curve "
               f"{c.curve_hit_rate:.4f}, Belady {c.belady_hit_rate:.4f})" for c in plan.candidates),
             "  memory account:", *plan.account.describe()]
    return "\n".join(lines)


def profile_words(dev: Any) -> str:
    """A device profile in a few words: what a prediction was made for."""
    return (f"{dev.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {dev.latency_s * 1e6:.0f} us a read, "
            f"{dev.queue_depth} in service")


def cost_words(cost: Any) -> str:
    """A cost model in a few words (its per-layer and per-step seconds)."""
    return f"{cost.per_layer_s * 1e3:.3f} ms a layer + {cost.per_step_s * 1e3:.3f} ms a step"


def register(sub: Any, fmt: Any) -> None:
    p = sub.add_parser("plan", help="choose the fastest pool configuration that fits a memory budget",
                       formatter_class=fmt,
                       description="Plan a model's memory: per-layer resident slots, eviction policy and prefetch that\n"
                       "run fastest in --memory, chosen on a routing log. Each layer's miss-ratio curve (LRU and\n"
                       "Belady, one pass) allocates the slots the budget leaves after the non-expert weights, the\n"
                       "KV cache and recurrent state at --context and MLX's buffer cache; a few candidates at equal\n"
                       "memory (planned vs uniform slots, LRU vs LFU, prefetch into the main region when the log\n"
                       "has the gates' candidates) are replayed exactly on a simulated device and the fastest is\n"
                       "kept. Its predicted tok/s and hit rate ARE that replay's. Budget units: GB = GiB = 2^30\n"
                       "bytes (8GB = 8GiB = 8G; 8000MB = 8000 x 2^20). docs/plan.md.",
                       epilog="examples:\n"
                       "  qnpipe plan ./qn80b-4bit --memory 8GB                   synthetic log of the shape\n"
                       "  qnpipe generate ./qn80b-4bit -p 'hi' -n 256 --trace run.qtrace\n"
                       "  qnpipe plan ./qn80b-4bit --memory 8GB --log run.qtrace -o plan.json --plot plan.png\n"
                       "  qnpipe plan ./qn80b-4bit --memory 24GB --log run.qtrace --device measured --cost run.cost.json\n"
                       "  qnpipe plan --shape Qwen3-Next-80B-A3B-Instruct/config.json --bits 4 --memory 16GB\n"
                       "  qnpipe plan ./qn80b-4bit --memory 24GB --ranks 2          two Macs, 24 GiB each\n")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="a `qnpipe convert` output directory")
    p.add_argument("--memory", required=True, metavar="SIZE", help="the budget, e.g. 8GB, 8GiB, 8000MB, 8G")
    p.add_argument("--log", metavar="LOG", help="routing or event log of this model (generate --trace); "
                   "default: plan.log, else the log a run recorded in MODEL_DIR (<expert dir>/trace.qtrace, as "
                   "--memory reads), else a synthetic log of its shape")
    p.add_argument("--device", default=None, metavar="NAME|FILE",
                   help="simulated device: measured (default, plan.device: this machine's, measured once and kept "
                        "in the user cache; qnpipe bench io measures more), a built-in profile, or a profile file")
    p.add_argument("--cost", metavar="COST", help="compute cost model (qnpipe trace fit-cost; default plan.cost_path, "
                   "else the default model)")
    p.add_argument("--context", type=int, default=8192, metavar="TOKENS", help="context the KV cache must hold")
    p.add_argument("--headroom", default="0", metavar="SIZE", help="kept for the OS and page cache (default 0)")
    p.add_argument("--shape", metavar="CONFIG_JSON", help="plan a model given by its config.json alone (before converting)")
    p.add_argument("--bits", type=int, default=None, help="with --shape: expert bits (default: the config's "
                   "quantization, else its float dtype)")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan (JSON) here")
    p.add_argument("--plot", metavar="FILE", help="draw tok/s and hit rate against the budget, and the slots per layer "
                   "(.png, .pdf or .svg by its suffix)")
    add_figure_flags(p)
    p.add_argument("--window-layer-steps", type=int, default=12_000, metavar="N",
                   help="timing replays cover the log's last N layer-steps (default 12000)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="plan a pipeline of N ranks (--distributed), --memory each: the layers split by the memory "
                        "account, each rank's plan (-o PLAN writes PLAN.rank<r>), the pipeline's predicted tok/s")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    add_config_flags(p, prefill=False, example="pool.evict_policy=lru")
    p.set_defaults(func=cmd_plan)
