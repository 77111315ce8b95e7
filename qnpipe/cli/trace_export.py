"""`qnpipe trace export`: an event log's timeline in a standard format (Chrome/Perfetto trace events)."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_export(args: argparse.Namespace) -> int:
    from qnpipe.io.clobber import check_outputs
    from qnpipe.trace import read
    from qnpipe.trace.perfetto import write
    from qnpipe.trace.timeline import parse_steps, timeline

    check_outputs([("--perfetto", args.perfetto)], [("LOG", args.log)])
    window = parse_steps(args.steps) if args.steps else (0, None)  # every step: an export is the whole log
    header, records = read(args.log)
    tl = timeline(header, records, window, path=args.log)
    write(tl, args.perfetto, log=args.log)
    print(f"{args.perfetto}: steps {tl.first}..{tl.last}, {len(tl.compute)} compute and {len(tl.stalls)} stall "
          f"slices on {len(tl.layers)} layers, {len(tl.reads)} reads on {tl.lanes} device lanes")
    return 0


def register(tsub: Any, fmt: Any) -> None:
    p = tsub.add_parser("export", help="write an event log's timeline as Chrome/Perfetto trace events (JSON)",
                        formatter_class=fmt,
                        description="Write the timeline of an event log (a live run's, qnpipe generate --trace, or a\n"
                        "replay's, --set trace.event_log_path=FILE) as Chrome trace events, the JSON that\n"
                        "ui.perfetto.dev and chrome://tracing open: per MoE layer its compute and stalls, per\n"
                        "device lane each read (demand, prefetch in time / late / unused) with its hint, issue\n"
                        "and need times, the steps, and the hints (docs/trace-format.md, Perfetto export).",
                        epilog="examples:\n"
                        "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 16 --trace run.qtrace\n"
                        "  qnpipe trace export run.qtrace --perfetto run.json             every step\n"
                        "  qnpipe trace export run.qtrace --perfetto late.json --steps 10:13")
    p.add_argument("log", metavar="LOG", help="event log, docs/trace-format.md")
    p.add_argument("--perfetto", metavar="OUT.json", required=True, help="the trace-event JSON file to write")
    p.add_argument("--steps", metavar="A:B",
                   help="only the log's steps numbered A to B-1 (as trace plot --steps); default: every step")
    p.set_defaults(func=cmd_export)
