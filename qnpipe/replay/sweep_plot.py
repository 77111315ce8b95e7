"""PNG plots of a sweep: one metric against each swept field (matplotlib, Agg backend, no pyplot state).

For a field, each combination of the other fields' values is one line; numeric values go on
a numeric axis in order, other values (names, layer sets) one tick each in grid order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qnpipe.io.atomic import atomic_file
from qnpipe.replay.sweep import SweepResult, fmt_value

MAX_LEGEND = 12  # more lines than this: no legend (it would cover the plot)


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
        label = ", ".join(f"{k}={fmt_value(v)}" for k, v in p.values.items() if k != field)
        lines.setdefault(label, []).append((x, p.metrics[metric]))
    return xs, lines


def file_name(metric: str, field: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{metric}-vs-{field}") + ".png"


def plot(result: SweepResult, metric: str, out_dir: str | Path) -> list[Path]:
    """Write `<metric>-vs-<field>.png` in `out_dir` (created) for every swept field; the paths written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for field in result.fields:
        xs, lines = series(result, field, metric)
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        numeric = _numeric(xs)
        pos = {x if numeric else fmt_value(x): (x if numeric else i) for i, x in enumerate(xs)}
        for label, pts in lines.items():
            if numeric:
                pts = sorted(pts, key=lambda p: p[0])
            ax.plot([pos[x if numeric else fmt_value(x)] for x, _ in pts], [y for _, y in pts], marker="o",
                    label=label or None)
        if not numeric:
            ax.set_xticks(list(range(len(xs))), [fmt_value(x) for x in xs])
        elif len(xs) <= MAX_LEGEND:
            ax.set_xticks(sorted(xs), [fmt_value(x) for x in sorted(xs)])
        ax.set_xlabel(field)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against {field}  ({Path(result.log).name}, {len(result.points)} points)", fontsize=9)
        ax.grid(True, alpha=0.3)
        if 1 < len(lines) <= MAX_LEGEND:
            ax.legend(fontsize=7)
        path = out / file_name(metric, field)
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=110)
        written.append(path)
    return written


__all__ = ["MAX_LEGEND", "file_name", "plot", "series"]
