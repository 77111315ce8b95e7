"""`qnpipe trace ...`: the tools around event logs (import, stats, synth, plot, export, fit-cost, merge).

Each `trace` subcommand lives in its own module with a `register(tsub, fmt)`; TRACE_COMMANDS
lists them. The group is added only when it has at least one.
"""

from __future__ import annotations

from typing import Any

from qnpipe.cli import (
    trace_export,
    trace_fit_cost,
    trace_import,
    trace_merge,
    trace_plot,
    trace_stats_cmd,
    trace_synth,
)

TRACE_COMMANDS: tuple[Any, ...] = (trace_import, trace_stats_cmd, trace_synth, trace_plot, trace_export,
                                 trace_fit_cost, trace_merge)


def register(sub: Any, fmt: Any) -> None:
    if not TRACE_COMMANDS:
        return
    t = sub.add_parser("trace", help="work with event logs: import, stats, synth, plot, export, fit-cost, merge", formatter_class=fmt,
                       description="Tools around event logs (docs/trace-format.md): import other tools' routing\n"
                       "logs, describe a log, write synthetic ones, draw a timeline or export it for Perfetto,\n"
                       "fit a cost model.",
                       epilog="examples:\n"
                       "  qnpipe trace import vllm-jsonl moe_layer0.jsonl -o qwen15-l0.qtrace\n"
                       "  qnpipe trace import vllm-jsonl 'Logs/moe_layer*.jsonl' -o qwen15.qtrace --batched\n"
                       "  qnpipe trace import csv routes.csv -o mine.qtrace\n"
                       "  qnpipe trace stats run.qtrace --json\n"
                       "  qnpipe trace synth -o synth.qtrace --layers 48 --experts 512 --top-k 10 --seed 1\n"
                       "  qnpipe trace plot run.qtrace -o timeline.png --steps 10:14\n"
                       "  qnpipe trace export run.qtrace --perfetto run.json\n"
                       "  qnpipe trace fit-cost run.qtrace -o cost.json --device measured\n"
                       "  qnpipe trace merge run.rank0.qtrace run.rank1.qtrace -o run.qtrace\n"
                       "each subcommand has its own --help.")
    tsub = t.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    for module in TRACE_COMMANDS:
        module.register(tsub, fmt)
