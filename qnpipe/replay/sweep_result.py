"""A sweep's results: every point's report and headline metrics in grid order, as tidy rows, and the
table's columns and number formats (`qnpipe sweep` prints them, qnpipe.replay.export writes the rows)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from qnpipe.errors import ConfigError
from qnpipe.replay.report import ReplayReport, metric_names, report_rows

# Columns of the table, when the report has them (any numeric metric can be chosen as well).
TABLE_METRICS = ("slots_per_layer", "memory_bytes", "tok_s", "hit_rate", "belady_hit_rate", "misses",
                 "stall_s_per_token", "bytes_per_token", "device_utilisation")


class PointResult(msgspec.Struct, frozen=True, kw_only=True):
    """One point: its report and metrics, or (`error`, then no report and no metrics) why it failed."""

    index: int
    values: dict[str, Any]
    metrics: dict[str, float]
    report: ReplayReport | None
    error: str | None = None


class SweepResult(msgspec.Struct, frozen=True, kw_only=True):
    """A sweep: the swept fields and every point's values, headline metrics and whole report, in grid order."""

    log: str
    fields: list[str]
    points: list[PointResult]

    @property
    def failed(self) -> list[int]:
        """The indices of the points that failed."""
        return [p.index for p in self.points if p.error is not None]

    def rows(self, settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every replayed point's tidy rows, the swept values as columns (`sweep_rows`)."""
        return sweep_rows(self, settings)


def sweep_rows(result: SweepResult, settings: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every replayed point's `report_rows`, led by `point` (its grid index) and the swept fields' values."""
    rows: list[dict[str, Any]] = []
    for p in result.points:
        if p.report is None:
            continue
        cols = {"point": p.index, **p.values}
        rows += report_rows(p.report, cols | {k: v for k, v in (settings or {}).items() if k not in cols})
    return rows


def check_metric(name: str) -> str:
    """`name`, or ConfigError listing the metrics when it is none of them."""
    if name not in metric_names():
        raise ConfigError(f"--metric {name!r}: unknown, known: {', '.join(metric_names())}")
    return name


def fmt_metric(name: str, v: float) -> str:
    """A metric's value in the table's unit (MiB, ms, a count, 4 digits)."""
    if not math.isfinite(v):
        return str(v)
    if name == "memory_bytes":
        return f"{v / 2**20:.1f} MiB"
    if name == "bytes_per_token":
        return f"{v / 2**20:.3f} MiB"
    if name.endswith("_s_per_token") or name == "virtual_s":
        return f"{v * 1e3:.3f} ms"
    if name in ("misses", "reads", "steps", "tokens"):
        return f"{v:.0f}"
    return f"{v:.4g}"


def table_metrics(metric: str) -> list[str]:
    """The table's columns: TABLE_METRICS, then `metric` when it is not one of them."""
    return list(dict.fromkeys([*TABLE_METRICS, metric]))


__all__ = ["TABLE_METRICS", "PointResult", "SweepResult", "check_metric", "fmt_metric", "sweep_rows", "table_metrics"]
