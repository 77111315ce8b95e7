"""`qnpipe trace synth`: write a seeded synthetic routing log (qnpipe.replay.synth)."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_synth(args: argparse.Namespace) -> int:
    from qnpipe.io.clobber import check_outputs
    from qnpipe.replay.synth import SynthSpec, write_synth

    popularity = args.popularity if args.popularity != "uniform" and not args.popularity.startswith("zipf:") else None
    check_outputs([("-o", args.output)], [("--popularity", popularity)])
    spec = SynthSpec(layers=args.layers, experts=args.experts, top_k=args.top_k, tokens=args.tokens, seed=args.seed,
                     locality=args.locality, cross_layer=args.cross_layer, popularity=args.popularity,
                     reuse_depth=args.reuse_depth)
    if args.calibrate:
        from qnpipe.replay.synth_calibrate import calibrate, parse_targets

        targets = parse_targets(args.calibrate)
        spec, got = calibrate(spec, targets)
        want = {**{f"lru:{c}": r for c, r in targets.lru.items()},
                **({f"hot:{targets.hot_k}": targets.hot_share} if targets.hot_k else {})}
        print(f"calibrated: --popularity {spec.popularity} --locality {spec.locality} --reuse-depth {spec.reuse_depth}")
        for k, v in got.items():
            print(f"  {k}: {v:.4f} (target {want[k]:.4f})")
    path = write_synth(args.output, spec)
    print(f"{path}: {spec.tokens} steps x {spec.layers} MoE layers, {spec.experts} experts, top-{spec.top_k}")
    return 0


def register(tsub: Any, fmt: Any) -> None:
    s = tsub.add_parser("synth", help="write a seeded synthetic routing log at any shape", formatter_class=fmt,
                        description="Write a routing log (docs/trace-format.md) of one-token steps whose experts are\n"
                        "drawn from per-layer popularity, with tunable temporal locality (reuse the previous\n"
                        "token's expert) and cross-layer correlation (a fixed partner of the previous layer's\n"
                        "expert). The same arguments always give the same bytes. Replay it with\n"
                        "`qnpipe replay LOG --set replay.record_nbytes=N` (docs/replay.md).",
                        epilog="examples:\n"
                        "  qnpipe trace synth -o synth.qtrace --layers 48 --experts 512 --top-k 10 --tokens 1000 --seed 1\n"
                        "  qnpipe trace synth -o local.qtrace --locality 0.6 --cross-layer 0.5 --popularity zipf:1.1\n"
                        "  qnpipe trace synth -o 80b.qtrace --tokens 2000 --seed 1 --calibrate "
                        "lru:64=0.67,lru:128=0.81,hot:32=0.10\n"
                        "  qnpipe trace synth -o q30b.qtrace --experts 128 --top-k 8 --popularity "
                        "traces/raw/sarelWeinberger__qwen-hebrew-finetuning/"
                        "moe_all_layers_analysis_gsm_en_he_500_20250921_115824_avg_activation.csv")
    s.add_argument("-o", "--output", required=True, metavar="LOG", help="the routing log to write")
    s.add_argument("--layers", type=int, default=48, help="MoE layers (default %(default)s)")
    s.add_argument("--experts", type=int, default=512, help="experts per layer (default %(default)s)")
    s.add_argument("--top-k", type=int, default=10, help="experts per token (default %(default)s)")
    s.add_argument("--tokens", type=int, default=1000, help="steps of one token each (default %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="the generator's seed (default %(default)s)")
    s.add_argument("--locality", type=float, default=0.0, metavar="X",
                   help="P(an expert repeats the previous token's at that layer and position), in [0, 1]")
    s.add_argument("--cross-layer", type=float, default=0.0, metavar="Y",
                   help="P(an expert is the fixed partner of the previous layer's, when not repeated), in [0, 1]")
    s.add_argument("--popularity", default="uniform", metavar="FILE|zipf:A",
                   help="per-layer popularity: uniform (default), zipf:A (ranks shuffled per layer) or a CSV "
                   "with a Layer column and Expert_<i> columns (the Qwen3-30B tables: SOURCES.md §5)")
    s.add_argument("--reuse-depth", type=int, default=1, metavar="D",
                   help="a repeated expert is the one of the token d back, d uniform in 1..D (default 1: the previous)")
    s.add_argument("--calibrate", metavar="POINTS",
                   help="fit --popularity (zipf), --locality and --reuse-depth to per-layer points, e.g. "
                   "lru:64=0.67,lru:128=0.81,hot:32=0.10 (LRU hit rate at a capacity; a static hot list's share)")
    s.set_defaults(func=cmd_synth)
