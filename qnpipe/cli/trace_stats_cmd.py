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
                        "Gini), distinct experts per step (union), reuse distance (distinct other experts of the\n"
                        "layer used in the steps between an expert's previous use and this one),\n"
                        "the share of a token's experts its previous token also chose; a summary row `all`\n"
                        "(counts summed over the layers, shares pooled, popularity averaged); the reuse-distance\n"
                        "histogram of all layers, binned 0, 1, 2-3, 4-7, ... with the cumulative share (reuses at\n"
                        "distance < c: an upper bound on the reuses an LRU of c slots per layer hits; the pool holds\n"
                        "a step's experts together, serves them in ascending id, and so may hit fewer:\n"
                        "`qnpipe replay LOG --mrc` gives the exact LRU hit rates); and per pair of\n"
                        "consecutive layers, how well a transition table from the first half of the tokens\n"
                        "predicts the next layer's top-k on the second half, beside the most popular experts.\n"
                        "--json gives everything, with the exact histogram per layer and in `total`:\n"
                        "reuse_counts[d] = the reuses at distance d.\n"
                        "Definitions: docs/trace-tools.md.",
                        epilog="examples:\n"
                        "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 32 --trace run.qtrace\n"
                        "  qnpipe trace stats run.qtrace\n"
                        "  qnpipe trace import mixtral-jsonl routing_raw.jsonl -o mixtral.qtrace\n"
                        "  qnpipe trace stats mixtral.qtrace --json\n"
                        "reading the histogram (Mixtral, 8 experts top-2):\n"
                        "     distance    reuses  share <= cum\n"
                        "            0      8565  0.402  0.402    40% of reuses: the expert was used the step before\n"
                        "            1         0  0.000  0.402\n"
                        "          2-3      5219  0.245  0.647    at most 65% of reuses hit in an LRU of 4 slots\n"
                        "  (the pool's LRU at 4 slots: 0.624 of all requests, `qnpipe replay LOG --mrc`)")
    p.add_argument("log", metavar="LOG", help="event or routing log (docs/trace-format.md)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    p.set_defaults(func=cmd_stats)
