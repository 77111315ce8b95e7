"""`qnpipe trace merge`: one log from the per-rank logs of a distributed run (qnpipe.trace.merge)."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_merge(args: argparse.Namespace) -> int:
    from qnpipe.io.clobber import check_outputs
    from qnpipe.trace import check_output_path
    from qnpipe.trace.merge import merge

    check_output_path(args.output, "merged log (-o)")  # before the inputs are read
    check_outputs([("-o", args.output)], [("LOG", p) for p in args.logs])
    m = merge(args.logs, args.output)
    print(f"{m.path}: {m.records} records of ranks {', '.join(map(str, m.ranks))}"
          + (f" ({m.dropped} dropped by the recorders)" if m.dropped else ""))
    return 0


def register(tsub: Any, fmt: Any) -> None:
    s = tsub.add_parser("merge", help="merge the per-rank logs of a distributed run into one", formatter_class=fmt,
                        description="A run started with --distributed writes one event or routing log per rank\n"
                        "(FILE.rank0.qtrace, FILE.rank1.qtrace, ...), each with its own layers' records timed by\n"
                        "its own clock. `merge` writes the log of the whole run: every rank's times moved onto\n"
                        "the first rank's clock by the wall-clock reading in each header, records ordered by\n"
                        "(time, rank), the layers and capacities of all ranks. The result works with every\n"
                        "tool that takes a log (trace stats, trace plot, replay, sweep). Ranks come from the\n"
                        "run each rank's header names (a distributed run writes its id, the rank and its\n"
                        "layers), else from the `.rank<N>` in the names, else from the order given. Refused,\n"
                        "naming the file: a log given twice, logs of two runs, a rank twice or missing, a\n"
                        "layer in two logs or in none.",
                        epilog="examples:\n"
                        "  mlx.launch --backend ring -n 2 -- qnpipe generate ./m -p 'hi' --trace run.qtrace\n"
                        "  qnpipe trace merge run.rank0.qtrace run.rank1.qtrace -o run.qtrace\n"
                        "  qnpipe replay run.qtrace --predict previous")
    s.add_argument("logs", nargs="+", metavar="LOG", help="the logs of the ranks (two or more) of one run")
    s.add_argument("-o", "--output", required=True, metavar="LOG", help="the merged log to write")
    s.set_defaults(func=cmd_merge)
