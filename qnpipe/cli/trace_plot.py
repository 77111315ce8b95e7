"""`qnpipe trace plot`: a timeline plot (PNG, PDF or SVG) of a window of steps of an event log (compute, reads, stalls)."""

from __future__ import annotations

import argparse
from typing import Any

from qnpipe.cli.figure_flags import add_figure_flags, figure_options
from qnpipe.io.figure import PLOT_FORMATS


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qnpipe.io.clobber import check_outputs
    from qnpipe.io.figure import check_format, format_of, provenance
    from qnpipe.trace import read
    from qnpipe.trace.plot import draw
    from qnpipe.trace.timeline import parse_steps, timeline

    fmt = check_format(args.plot_format) if args.plot_format else format_of(args.output)
    opts = figure_options(args)
    check_outputs([("-o", args.output)], [("LOG", args.log)])
    window = parse_steps(args.steps) if args.steps else (None, None)
    header, records = read(args.log)
    tl = timeline(header, records, window, path=args.log)
    draw(tl, args.output, title=f"{Path(args.log).name}: steps {tl.first}..{tl.last}", fmt=fmt, opts=opts,
         source=provenance(log=args.log, extra=f"the run's config fingerprint {header.fingerprint[:16]}"))
    late = sum(r.outcome == "late" for r in tl.reads)
    print(f"{args.output}: steps {tl.first}..{tl.last}, {len(tl.layers)} layers, {len(tl.reads)} reads on "
          f"{tl.lanes} lanes ({late} late prefetches), {len(tl.stalls)} stalls")
    return 0


def register(tsub: Any, fmt: Any) -> None:
    p = tsub.add_parser("plot", help="draw a timeline of a window of steps (compute, reads per lane, stalls)",
                        formatter_class=fmt,
                        description="Draw a timeline (PNG, PDF or SVG) of a window of steps of an event log (a live run's,\n"
                        "qnpipe generate --trace, or a replay's, qnpipe replay --set trace.event_log_path=FILE):\n"
                        "per MoE layer its compute and stalls; per device lane every read from the device\n"
                        "start to completion, coloured demand / prefetch in time / late / unused, with each\n"
                        "prefetch's hint and issue time and the moment the forward needed it.",
                        epilog="examples:\n"
                        "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 16 --trace run.qtrace\n"
                        "  qnpipe trace plot run.qtrace -o run.png                 the first 4 steps\n"
                        "  qnpipe trace plot run.qtrace -o late.png --steps 10:13  steps 10, 11 and 12\n"
                        "  qnpipe replay run.qtrace --predict previous --set trace.event_log_path=re.qtrace\n"
                        "  qnpipe trace plot re.qtrace -o re.png --steps 5")
    p.add_argument("log", metavar="LOG", help="event log, docs/trace-format.md")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="the plot file to write")
    p.add_argument("--plot-format", choices=PLOT_FORMATS,
                   help="the file format (default: by the -o name's suffix, .pdf or .svg, else png)")
    p.add_argument("--steps", metavar="A:B",
                   help="the log's steps numbered A to B-1 (step numbers count from 1, as the log and `trace stats` "
                   "number them; half-open: A: = from A on, :B = before B, : = all; A alone = step A); "
                   "default: the first 4 steps")
    add_figure_flags(p)
    p.set_defaults(func=cmd_plot)
