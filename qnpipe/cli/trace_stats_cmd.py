"""`qnpipe trace stats LOG`: popularity skew, reuse distance, unions and cross-layer predictability of a log."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_stats(args: argparse.Namespace) -> int:
    from qnpipe.trace.stats import describe, to_json, trace_stats

    s = trace_stats(args.log)
    print(to_json(s).decode() if args.json else describe(s))
    return 0


def register(tsub: Any, fmt: Any) -> None:
    p = tsub.add_parser("stats", help="describe a log's routing: skew, reuse, unions, cross-layer predictability",
                        formatter_class=fmt,
                        description="Statistics of the routes in a log (qnpipe generate --trace, or qnpipe trace import),\n"
                        "per MoE layer: popularity skew (share of the top 10% of experts, normalised entropy,\n"
                        "Gini), distinct experts per step (union), reuse distance (distinct other experts since\n"
                        "an expert's previous use: an LRU cache of more slots still holds it), the share of a\n"
                        "token's experts its previous token also chose; and per pair of consecutive layers, how\n"
                        "well a transition table from the first half of the tokens predicts the next layer's\n"
                        "top-k on the second half, beside predicting the most popular experts.\n"
                        "Definitions: docs/trace-tools.md.",
                        epilog="examples:\n"
                        "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 32 --trace run.qtrace\n"
                        "  qnpipe trace stats run.qtrace\n"
                        "  qnpipe trace import mixtral-jsonl routing_raw.jsonl -o mixtral.qtrace\n"
                        "  qnpipe trace stats mixtral.qtrace --json")
    p.add_argument("log", metavar="LOG", help="event or routing log (docs/trace-format.md)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    p.set_defaults(func=cmd_stats)
