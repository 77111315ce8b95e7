"""A miss-ratio curve result as a CSV, a plot and a short text summary (qnpipe.replay.mrc computes it).

The plot draws the miss ratio (1 - hit rate: the fraction of expert requests read on demand), as
its name says; the CSV and the summary keep the hit rate.

The CSV is long format, one row per (policy, layer, capacity): `policy,layer,capacity,hits,requests,hit_rate`,
with `layer` = `all` for the total over every layer the log routes. Files are written atomically
with the usual permissions (qnpipe.io.atomic: 0666 less the umask, never the temp file's 0600).
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Sequence
from pathlib import Path

from qnpipe.io.atomic import atomic_file
from qnpipe.io.figure import DEFAULT_OPTIONS, FigureOptions, finish, format_of, provenance, save
from qnpipe.replay.mrc import ALL, MrcResult

COLUMNS = ("policy", "layer", "capacity", "hits", "requests", "hit_rate")
STYLE = {"lru": ("-", "tab:blue"), "belady": ("--", "tab:red")}  # (line style, colour of the total)
LAYER_COLOURS = ("C2", "C4", "C1", "C5", "C6", "C8", "C9", "C7")  # never the totals' blue and red
LABEL = {"lru": "LRU", "belady": "Belady (optimal)"}


def write_csv(result: MrcResult, path: str | Path) -> Path:
    """Write the curves' rows (COLUMNS) to `path`; returns it."""
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(COLUMNS)
    for row in result.rows():
        w.writerow([row[c] if c != "hit_rate" else repr(row[c]) for c in COLUMNS])
    with atomic_file(path) as f:
        f.write(text.getvalue().encode())
    return Path(path)


def summary_capacities(result: MrcResult) -> list[int]:
    """A few capacities worth printing: top-k, then doubling, and the expert count."""
    k, e = result.min_capacity, result.shape.num_experts
    caps = {k, e}
    c = max(k, 1)
    while c < e:
        caps.add(c)
        c *= 2
    return sorted(caps)


def summary(result: MrcResult) -> str:
    """The total hit rate of each policy at `summary_capacities`, as a table for a terminal."""
    policies = [p for p in ("lru", "belady") if any(c.policy == p for c in result.curves)]
    n_layers = len({c.layer for c in result.curves} - {ALL})
    lines = [f"miss-ratio curves of {result.log}: {n_layers} of {len(result.shape.moe_layers)} MoE layers routed, "
             f"{result.shape.num_experts} experts, top-{result.shape.top_k}; hit rate over all layers "
             f"(demand only, a step's experts held together; LRU, where a replay without --mrc uses "
             f"pool.evict_policy, lfu by default)",
             "  " + f"{'slots':>6}" + "".join(f" {LABEL[p].split()[0]:>8}" for p in policies)]
    for cap in summary_capacities(result):
        i = cap - result.min_capacity
        lines.append("  " + f"{cap:>6}" + "".join(f" {result.curve(p).hit_rate()[i]:>8.3f}" for p in policies))
    return "\n".join(lines)


def not_monotone(result: MrcResult, layers: Sequence[int] = ()) -> bool:
    """Whether a Belady curve drawn (the total, or one of `layers`) loses hits as the capacity grows: on a log
    whose steps route several tokens, holding a step's experts together makes furthest-next-use not optimal."""
    return any(c.policy == "belady" and (c.layer == ALL or c.layer in layers)
               and any(b < a for a, b in itertools.pairwise(c.hits)) for c in result.curves)


def plot(result: MrcResult, path: str | Path, *, layers: Sequence[int] = (), fmt: str | None = None,
         opts: FigureOptions = DEFAULT_OPTIONS) -> Path:
    """Miss ratio against slots per layer: each policy's total (thick), and `layers`' own curves (thin); written
    as `fmt` (default: by the file name's suffix, .pdf or .svg, else PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=opts.figsize((7.0, 4.6)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shades = {layer: LAYER_COLOURS[i % len(LAYER_COLOURS)] for i, layer in enumerate(layers)}  # both policies
    falls = not_monotone(result, layers)
    for c in result.curves:
        if isinstance(c.layer, int) and c.layer not in shades:
            continue
        total = c.layer == ALL
        name = LABEL.get(c.policy, c.policy)
        if c.policy == "belady" and falls:
            name = "Belady (furthest next use; not monotone here)"
        style, colour = STYLE.get(c.policy, ("-", "black"))
        ax.plot(c.capacities, [1.0 - h for h in c.hit_rate()], linestyle=style,
                color=colour if not isinstance(c.layer, int) else shades[c.layer],
                linewidth=2.0 if total else 0.9, label=f"{name}, all layers" if total else f"{name}, layer {c.layer}")
    ax.set_xlabel("capacity (expert slots per layer)")
    ax.set_ylabel("miss ratio (fraction of expert requests read)")
    ax.set_ylim(bottom=0.0)
    # top-k = the expert count leaves one capacity: a zero-width range, which matplotlib warns of on stderr
    ax.set_xlim(min(result.min_capacity, result.shape.num_experts - 1), result.shape.num_experts)
    ax.set_title(f"miss-ratio curves, demand only ({len(result.shape.moe_layers)} MoE layers, "
                 f"{result.shape.num_experts} experts, top-{result.shape.top_k})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    extra = ("Belady holds a step's experts together: on this log it is not optimal and can lose hits as "
             "slots are added" if falls else "")
    finish(fig, ax, opts, provenance(log=result.log, device="none (hit and miss counts only)", extra=extra))
    return save(fig, path, fmt or format_of(path), dpi=opts.dpi)


__all__ = ["COLUMNS", "not_monotone", "plot", "summary", "summary_capacities", "write_csv"]
