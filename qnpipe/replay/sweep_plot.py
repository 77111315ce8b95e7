"""Plots of a sweep: one metric against each swept field (matplotlib, Agg backend, no pyplot state).

For a field, each combination of the other fields' values is one series. Numeric values go on
a numeric axis, joined in order; other values (policy names, layer sets) are categories: one
tick each in grid order, the series' points side by side within it, never joined (a line
between two policies would suggest values between them). Every series has its own marker
(hollow, and on a numeric axis of another size, so points that coincide stay visible) and
line style. A hit-rate plot also shows Belady's hit rate at the same points (the demand-only
optimum at the resident slots), with a note when it falls as the slots rise (on logs whose steps
route several tokens, holding a step's experts together makes the furthest-next-use rule no
longer optimal nor monotone). Axis labels come from `LABELS` (what the field is, and its unit),
never the raw key, and long labels, ticks and legend entries are wrapped to stay on the canvas;
the legend sits outside the axes. Every y axis starts at 0 (no metric here is negative, and a
1 % spread drawn over the full height reads as a cliff). The last line names what produced the
numbers: qnpipe's version, the log, the device profile and the cost model.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from qnpipe.io.figure import (
    DEFAULT_OPTIONS,
    FigureOptions,
    check_format,
    describe_cost,
    describe_device,
    finish,
    provenance,
    save,
    wrap,
)
from qnpipe.replay.sweep import SweepResult, fmt_value

MAX_LEGEND = 24  # more series than this: no legend (the title says how many)
# 9 markers against matplotlib's 10 colours: no colour and marker pair repeats before 90 series
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", "h")
STYLES = ("-", "--", "-.", ":")
BELADY = "belady_hit_rate"
HIT_RATES = ("hit_rate", "resident_hit_rate", "side_hit_rate", "victim_hit_rate", BELADY)
TICK_CHARS = 12  # a categorical tick's label wraps past this many characters
LEGEND_CHARS = 30  # and a legend entry past this many
NOT_MONOTONE = "Belady falls as the slots rise: with a step's experts held together it is not optimal"

# field or metric -> (what it is, unit, factor from the stored value to the unit)
LABELS: dict[str, tuple[str, str, float]] = {
    "tok_s": ("throughput", "steps / virtual s", 1.0),
    "hit_rate": ("hit rate", "fraction of expert requests", 1.0),
    "resident_hit_rate": ("resident hit rate", "fraction of expert requests", 1.0),
    "side_hit_rate": ("prefetched-in-time hit rate", "fraction of expert requests", 1.0),
    "victim_hit_rate": ("victim-region hit rate", "fraction of expert requests", 1.0),
    BELADY: ("Belady hit rate", "fraction of expert requests", 1.0),
    "misses": ("misses", "expert reads on demand", 1.0),
    "stall_s_per_token": ("stall", "ms per step", 1e3),
    "bytes_per_token": ("bytes read", "MiB per step", 2.0**-20),
    "device_utilisation": ("device busy", "fraction of virtual time", 1.0),
    "virtual_s": ("virtual time", "s", 1.0),
    "reads": ("device reads", "reads", 1.0),
    "steps": ("steps", "forwards", 1.0),
    "tokens": ("tokens", "tokens", 1.0),
    "train_steps": ("training steps", "steps", 1.0),
    "pool.expert_slots": ("resident expert slots", "per layer", 1.0),
    "pool.evict_policy": ("eviction policy", "", 1.0),
    "pool.side_region_slots": ("side-region (prefetch) slots", "per layer", 1.0),
    "pool.prefetch_into": ("prefetch placement", "", 1.0),
    "pool.autopin": ("autopin", "", 1.0),
    "read.workers": ("reader threads", "", 1.0),
    "predict.width_experts": ("prediction width", "experts per predicted layer", 1.0),
    "replay.predictor": ("predictor", "", 1.0),
    "replay.record_nbytes": ("expert record size", "MiB", 2.0**-20),
    "cost.per_layer_s": ("compute per MoE layer", "ms", 1e3),
    "cost.per_token_s": ("compute per token", "ms", 1e3),
    "cost.per_step_s": ("compute per step", "ms", 1e3),
    "cost.read_hop_s": ("read hop", "ms", 1e3),
    "device.bandwidth_bytes_per_s": ("device bandwidth", "GB/s", 1e-9),
    "device.latency_s": ("device latency", "µs", 1e6),
    "device.per_mb_latency_s": ("device latency per MB", "µs", 1e6),
    "device.queue_depth": ("device queue depth", "reads", 1.0),
}


def label(name: str) -> tuple[str, float]:
    """(axis label with its unit, factor to the unit) of a field or metric: `LABELS`, else a config
    field's own description (docs/config.md), else the name with its underscores as spaces."""
    if name in LABELS:
        what, unit, factor = LABELS[name]
        return (f"{what} ({unit})" if unit else what), factor
    from qnpipe.config import field_specs

    doc = next((s.doc for s in field_specs() if s.path == name), "")
    # a config field's doc runs on past its name ("where prefetches land: side (...) or main (...)"): its head
    head = re.split(r"[:;(]", doc, maxsplit=1)[0].strip() if doc else ""
    return (head or name.rpartition(".")[2].replace("_", " ")), 1.0


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def series(result: SweepResult, field: str, metric: str) -> tuple[list[Any], dict[str, list[tuple[Any, float]]]]:
    """(the field's distinct values in grid order, {label of the other fields' values: [(value, metric)]})."""
    xs: list[Any] = []
    lines: dict[str, list[tuple[Any, float]]] = {}
    for p in result.points:
        if p.error is not None:  # a failed point has no metrics: a gap in its line
            continue
        x = p.values[field]
        if x not in xs:
            xs.append(x)
        lines.setdefault(_series_label(p.values, field), []).append((x, p.metrics[metric]))
    return xs, lines


def short(name: str) -> str:
    """A field's or metric's label without its unit or asides: "side-region (prefetch) slots (per layer)" -> "side-region slots"."""
    return re.sub(r"\s*\([^)]*\)", "", label(name)[0])


def _series_label(values: dict[str, Any], field: str) -> str:
    return ", ".join(f"{short(k)} = {fmt_value(v)}" for k, v in values.items() if k != field)


def file_name(metric: str, field: str, fmt: str = "png") -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{metric}-vs-{field}") + f".{fmt}"


def plot(result: SweepResult, metric: str, out_dir: str | Path, *, fmt: str = "png",
         opts: FigureOptions = DEFAULT_OPTIONS) -> list[Path]:
    """Write `<metric>-vs-<field>.<fmt>` in `out_dir` (created) for every swept field; the paths written."""
    check_format(fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [save(figure(result, metric, field, opts), out / file_name(metric, field, fmt), fmt, dpi=opts.dpi)
            for field in result.fields]


def source(result: SweepResult) -> str:
    """The provenance line of a sweep's figures: the device profile and cost model of its points (or that they vary)."""
    reports = [p.report for p in result.points if p.report is not None]
    devices = {describe_device(r.device) for r in reports}
    costs = {describe_cost(r.cost) for r in reports}
    return provenance(log=result.log, device=devices.pop() if len(devices) == 1 else "varies (swept)",
                      cost=costs.pop() if len(costs) == 1 else "varies (swept)")


def figure(result: SweepResult, metric: str, field: str, opts: FigureOptions = DEFAULT_OPTIONS) -> Any:
    """The figure of `metric` against `field` (see the module doc)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    xs, lines = series(result, field, metric)
    belady = series(result, field, BELADY)[1] if metric in HIT_RATES and metric != BELADY else {}
    ylabel, yf = label(metric)
    xlabel, xf = label(field)
    numeric = _numeric(xs)
    legend = 1 < len(lines) <= MAX_LEGEND or bool(belady)
    fig = Figure(figsize=opts.figsize((7.6 if legend else 6.4, 4.2)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = list(itertools.islice(itertools.cycle(cycle), len(lines)))
    width = 0.7  # of a category's tick, shared by its series
    for i, (name, pts) in enumerate(lines.items()):
        style = {"color": colours[i], "marker": MARKERS[i % len(MARKERS)], "markerfacecolor": "none",
                 # on a numeric axis sizes differ, so that coinciding points nest instead of hiding each other
                 "markersize": 6 + 2 * ((len(lines) - 1 - i) % 3) if numeric else 7,
                 "label": wrap(name, LEGEND_CHARS) if name else metric}
        if numeric:
            pts = sorted(pts, key=lambda p: p[0])
            ax.plot([x * xf for x, _ in pts], [y * yf for _, y in pts], linestyle=STYLES[i % len(STYLES)], **style)
        else:
            dx = (i - (len(lines) - 1) / 2) * width / max(1, len(lines))
            ax.plot([xs.index(x) + dx for x, _ in pts], [y * yf for _, y in pts], linestyle="none", **style)
    _draw_belady(ax, belady, xs, numeric, xf, yf, colours, width)
    if not numeric:
        ticks = [wrap(fmt_value(x), TICK_CHARS) for x in xs]
        crowded = sum(max(len(line) for line in t.split("\n")) for t in ticks) > 6 * fig.get_figwidth()
        ax.set_xticks(list(range(len(xs))), ticks, rotation=30 if crowded else 0, ha="right" if crowded else "center")
        ax.set_xlim(-0.6, len(xs) - 0.4)
    elif len(xs) <= MAX_LEGEND:
        ax.set_xticks([x * xf for x in sorted(xs)], [fmt_value(x * xf if xf != 1.0 else x) for x in sorted(xs)])
    ax.set_ylim(bottom=0.0)
    if metric in HIT_RATES and ax.get_ylim()[1] > 1.0:
        ax.set_ylim(top=1.02)
    chars = int(fig.get_figwidth() * 11)  # ~11 characters of 10 pt text to the inch
    ax.set_xlabel(wrap(xlabel, chars))
    ax.set_ylabel(wrap(ylabel, int(fig.get_figheight() * 11)))
    many = f", {len(lines)} series" if len(lines) > MAX_LEGEND else ""
    ax.set_title(wrap(f"{short(metric)} against {short(field)} "
                      f"({len(result.points)} points{many})", chars), fontsize=9)
    ax.grid(True, alpha=0.3)
    finish(fig, ax, opts, source(result))
    if legend:
        fig.legend(loc="outside right upper", fontsize=7, frameon=False)
    return fig


def _draw_belady(ax: Any, belady: dict[str, list[tuple[Any, float]]], xs: list[Any], numeric: bool, xf: float,
                 yf: float, colours: list[str], width: float) -> None:
    """Belady's hit rate: one black dashed line when every series has the same (it depends on the slots, not
    the policy), else each series' own in its colour; on a categorical axis a bar across each point."""
    if not belady:
        return
    one = len({tuple(y for _, y in pts) for pts in belady.values()}) == 1
    falls = numeric and any(b[1] < a[1] - 1e-12 for pts in belady.values()
                            for a, b in itertools.pairwise(sorted(pts, key=lambda p: p[0])))
    dash = (0, (4, 2))
    for i, pts in enumerate(belady.values()):
        colour = "black" if one else colours[i]
        name = "Belady (demand-only optimum)" if i == 0 else None
        if name and falls:
            name = "Belady (demand-only, furthest next use);\n" + wrap(NOT_MONOTONE, LEGEND_CHARS)
        if numeric:
            pts = sorted(pts, key=lambda p: p[0])
            ax.plot([x * xf for x, _ in pts], [y * yf for _, y in pts], color=colour, linestyle=dash,
                    linewidth=1.2, alpha=0.8, label=name if one else None, zorder=1)
        else:
            slot = width / max(1, len(belady))
            # one line for every series: centred on the category, across all of its points
            at = [xs.index(x) + (0.0 if one else (i - (len(belady) - 1) / 2) * slot) for x, _ in pts]
            lo, hi = (([c - width / 2 for c in at], [c + width / 2 for c in at]) if one
                      else ([c - slot / 2 for c in at], [c + slot / 2 for c in at]))
            # solid: a dash pattern on a bar this short looks shifted off its point
            ax.hlines([y * yf for _, y in pts], lo, hi, colors=colour, linewidth=1.6, zorder=1,
                      label=name if one else None)
        if one:
            break
    if not one:  # one legend entry for all the series' Belady lines
        ax.plot([], [], color="grey", linestyle=dash if numeric else "-", linewidth=1.2,
                label="Belady (demand-only optimum),\nin each series' colour")


__all__ = ["LABELS", "MARKERS", "MAX_LEGEND", "NOT_MONOTONE", "STYLES", "figure", "file_name", "label", "plot",
           "series", "source"]
