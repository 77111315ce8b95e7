"""Writing a matplotlib figure as PNG, PDF or SVG: atomically, with the usual file mode, the same bytes each run.

PDF and SVG carry no creation date (matplotlib's metadata set to None) and SVG ids come from a
fixed salt, so a plot of the same data is the same file; the mode is what `qnpipe.io.atomic` gives every file (0o666 less the umask).
Text stays text in both vector formats (SVG `<text>` elements, PDF TrueType fonts, not outlines), so
a journal's editor can search and restyle it.

Every figure qnpipe draws takes `FigureOptions` (the title, axis labels, size and PNG resolution a
user may override) and ends with a provenance line (`provenance`): what produced the numbers.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import msgspec

from qnpipe._version import __version__
from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_file

PLOT_FORMATS = ("png", "pdf", "svg")
DPI = 200  # PNG only: the vector formats do not depend on it
PROVENANCE_PT = 6.0  # the provenance line's font size
_NO_DATE: dict[str, dict[str, Any]] = {"png": {}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}
# svg.hashsalt: the SVG's element ids are otherwise random on each run; fonttypes: text as text
_RC: dict[Any, Any] = {"svg.hashsalt": "qnpipe", "svg.fonttype": "none", "pdf.fonttype": 42}


class FigureOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a user may set on a figure; None keeps the figure's own."""

    title: str | None = None
    xlabel: str | None = None
    ylabel: str | None = None
    size: tuple[float, float] | None = None  # width, height in inches
    dpi: int | None = None  # PNG only

    def figsize(self, default: tuple[float, float]) -> tuple[float, float]:
        return self.size if self.size is not None else default


DEFAULT_OPTIONS = FigureOptions()


def check_format(fmt: str, where: str = "--plot-format") -> str:
    """`fmt`, or ConfigError naming `where` and the known formats."""
    if fmt not in PLOT_FORMATS:
        raise ConfigError(f"{where} {fmt}: unknown, known: {', '.join(PLOT_FORMATS)}")
    return fmt


def format_of(path: str | Path, default: str = "png") -> str:
    """The plot format a file name asks for by its suffix (.png, .pdf, .svg), else `default`."""
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in PLOT_FORMATS else default


def describe_device(device: Any) -> str:
    """A device profile in a few words: bandwidth, latency, queue depth."""
    per_mb = f" + {device.per_mb_latency_s * 1e6:g} µs/MB" if device.per_mb_latency_s else ""
    return (f"{device.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {device.latency_s * 1e6:g} µs{per_mb}, "
            f"queue depth {device.queue_depth}")


def describe_cost(cost: Any) -> str:
    """A cost model in a few words: its compute per layer, token and step, and its read hop."""
    parts = [f"{cost.per_layer_s * 1e3:g} ms/layer"]
    if cost.layer_table:
        parts[0] += f" ({len(cost.layer_table)} layers fitted)"
    parts += [f"{v * 1e3:g} ms/{what}" for v, what in ((cost.per_token_s, "token"), (cost.per_step_s, "step"),
                                                        (cost.per_miss_s, "miss"), (cost.read_hop_s, "read hop")) if v]
    return " + ".join(parts)


def provenance(*, log: str | Path | None = None, device: str | None = None, cost: str | None = None,
               extra: str = "") -> str:
    """The line saying what produced a figure: qnpipe's version, the log, the device profile and cost model."""
    parts = [f"qnpipe {__version__}"]
    if log is not None:
        parts.append(f"log {Path(log).name}")
    if device is not None:
        parts.append(f"device {device}")
    if cost is not None:
        parts.append(f"cost model {cost}")
    if extra:
        parts.append(extra)
    return "; ".join(parts)


def finish(fig: Any, ax: Any | None, opts: FigureOptions, line: str) -> None:
    """Apply the user's title and labels to `ax` (the figure's title when `ax` is None) and add the provenance
    line under everything, wrapped to the figure's width (as a supxlabel, so constrained layout makes room)."""
    if ax is not None:
        if opts.title is not None:
            ax.set_title(opts.title, fontsize=9)
        if opts.xlabel is not None:
            ax.set_xlabel(opts.xlabel)
        if opts.ylabel is not None:
            ax.set_ylabel(opts.ylabel)
    elif opts.title is not None:
        fig.suptitle(opts.title, fontsize=10)
    # ~0.55 em per character of the default sans font: the characters a line of the figure's width holds
    width = max(20, int(fig.get_figwidth() * 72 / (PROVENANCE_PT * 0.55)) - 4)
    fig.supxlabel(textwrap.fill(line, width), fontsize=PROVENANCE_PT, color="0.35")


def wrap(text: str, width: int) -> str:
    """`text` broken into lines of at most `width` characters (at spaces, commas and slashes where it can)."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) if len(text) > width else text


def save(fig: Any, path: str | Path, fmt: str, *, dpi: int | None = None) -> Path:
    """Write `fig` to `path` in `fmt` (PLOT_FORMATS) through a temporary name; the path."""
    import matplotlib

    check_format(fmt)
    with matplotlib.rc_context(_RC), atomic_file(path) as f:
        fig.savefig(f, format=fmt, dpi=dpi or DPI, metadata=_NO_DATE[fmt])
    return Path(path)


def outside_canvas(fig: Any) -> list[str]:
    """The texts of `fig` that reach outside its canvas (by matplotlib's own extents, after layout): empty when none."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox

    def outside(e: Any) -> bool:
        return e is not None and (e.x0 < box.x0 - 0.5 or e.y0 < box.y0 - 0.5 or e.x1 > box.x1 + 0.5
                                  or e.y1 > box.y1 + 0.5)

    out = []
    ticks: set[int] = set()
    for ax in fig.axes:
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            # tick labels: the axis's own extent, which counts only the ticks it draws (not those past the view)
            ticks |= {id(t) for t in axis.get_ticklabels(which="both")}
            ticks |= {id(tk.label2) for tk in axis.get_major_ticks() + axis.get_minor_ticks()}
            ticks |= {id(tk.label1) for tk in axis.get_major_ticks() + axis.get_minor_ticks()}
            if outside(axis.get_tightbbox(renderer)):
                out.append(f"{name} axis of {ax.get_title() or 'an axes'}")
    for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent")):
        if id(t) in ticks or not t.get_visible() or not t.get_text().strip():
            continue
        if outside(t.get_window_extent(renderer)):
            out.append(t.get_text())
    return out


__all__ = ["DEFAULT_OPTIONS", "DPI", "PLOT_FORMATS", "FigureOptions", "check_format", "describe_cost", "describe_device", "finish",
           "format_of", "outside_canvas", "provenance", "save", "wrap"]
