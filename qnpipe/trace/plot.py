"""Draw a `qnpipe.trace.timeline.Timeline` as a PNG, PDF or SVG (matplotlib, Agg backend, no pyplot state).

Top: one row per MoE layer, its compute (granted to released) and its stalls (waiting for
reads). Bottom: one row per device lane, each read from the moment its batch went to the
device to its completion, coloured by what became of it; a prefetch also shows its hint
(a triangle) and issue, joined to its bar by a thin line, and a tick where the forward
needed it (a dotted line from the bar's end to it: the slack of one that landed in time). Times are milliseconds from the window's start.
"""

from __future__ import annotations

import math
from pathlib import Path

from qnpipe.io.figure import DEFAULT_OPTIONS, FigureOptions, finish, provenance, save
from qnpipe.trace.timeline import Timeline

COLOURS = {"compute": "#4c72b0", "stall": "#c44e52", "demand": "#8c8c8c", "in time": "#55a868", "late": "#dd8452",
           "unused": "#c9b6e4"}
LABEL_READS = 80  # up to this many reads in the window, each bar is labelled with its layer and expert


def draw(tl: Timeline, out: str | Path, *, title: str = "", fmt: str = "png", opts: FigureOptions = DEFAULT_OPTIONS,
         source: str = "") -> Path:
    """Write the plot to `out` as `fmt` (png, pdf, svg; through a temporary name) and return its path. `source`
    is the provenance line (default: qnpipe's version alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ms = 1e3
    n_layers, n_lanes = max(1, len(tl.layers)), max(1, tl.lanes)
    fig = Figure(figsize=opts.figsize((13, min(30.0, 2.6 + 0.28 * (n_layers + n_lanes)))), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[n_layers + 1, n_lanes + 1])

    def x(t: float) -> float:
        return (t - tl.t0) * ms

    row = {layer: i for i, layer in enumerate(tl.layers)}
    for c in tl.compute:
        top.broken_barh([(x(c.start), (c.end - c.start) * ms)], (row[c.layer] - 0.4, 0.8), color=COLOURS["compute"])
    for s in tl.stalls:
        top.broken_barh([(x(s.start), (s.end - s.start) * ms)], (row[s.layer] - 0.4, 0.8), color=COLOURS["stall"])
    top.set_yticks(range(len(tl.layers)), [f"layer {ly}" for ly in tl.layers], fontsize=7)
    top.set_ylim(len(tl.layers) - 0.5, -0.5)
    top.set_ylabel("compute")

    label = len(tl.reads) <= LABEL_READS
    for r in tl.reads:
        y = r.lane
        bottom.broken_barh([(x(r.started_t), (r.done_t - r.started_t) * ms)], (y - 0.4, 0.8), color=COLOURS[r.outcome])
        first = r.hint_t if r.hint_t is not None else r.issued_t
        if r.started_t > first:
            bottom.plot([x(first), x(r.started_t)], [y, y], color=COLOURS[r.outcome], linewidth=0.8)
        if r.hint_t is not None:
            bottom.plot([x(r.hint_t)], [y], marker=">", markersize=4, color="black", linestyle="none")
        if r.needed_t is not None and r.needed_t > r.done_t:  # the slack of a prefetch that landed in time
            bottom.plot([x(r.done_t), x(r.needed_t)], [y, y], color=COLOURS[r.outcome], linewidth=0.8, linestyle=":")
        if r.needed_t is not None:
            bottom.plot([x(r.needed_t)], [y], marker="|", markersize=9, color="black", linestyle="none")
        if label:
            bottom.text(x(r.started_t), y, f" {r.layer}:{r.expert}", va="center", fontsize=5, clip_on=True)
    bottom.set_yticks(range(n_lanes), [f"lane {i}" for i in range(n_lanes)], fontsize=7)
    bottom.set_ylim(n_lanes - 0.5, -0.5)
    bottom.set_ylabel("device")
    bottom.set_xlabel(f"ms from the start of step {tl.first}")
    bottom.set_xlim(0, max(x(tl.t1), 1e-9) * 1.01)

    for ax in (top, bottom):
        for _, t in tl.step_starts:
            ax.axvline(x(t), color="black", linewidth=0.5, linestyle=":")
    room = 0.045 * max(x(tl.t1), 1e-9)  # a label's width: closer steps go unlabelled, not overprinted
    last = -math.inf
    for step, t in tl.step_starts:
        if x(t) - last >= room:
            top.annotate(f"step {step}", (x(t), 1), xycoords=("data", "axes fraction"), xytext=(2, 3),
                         textcoords="offset points", fontsize=7)
            last = x(t)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("compute", "stall")]
    handles += [Patch(color=COLOURS[k], label=f"read: {k}") for k in ("demand", "in time", "late", "unused")]
    handles += [Line2D([], [], marker=">", color="black", linestyle="none", label="hint"),
                Line2D([], [], marker="|", color="black", linestyle="none", markersize=9, label="needed")]
    # beside the axes: the bottom edge holds the provenance line, the top the title
    fig.legend(handles=handles, loc="outside right upper", fontsize=7, frameon=False)
    fig.suptitle(opts.title or title or f"steps {tl.first}..{tl.last}", fontsize=9)
    if opts.xlabel is not None:
        bottom.set_xlabel(opts.xlabel)
    finish(fig, None, FigureOptions(), source or provenance())
    return save(fig, out, fmt, dpi=opts.dpi)


__all__ = ["COLOURS", "LABEL_READS", "draw"]
