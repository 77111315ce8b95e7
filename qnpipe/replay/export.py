"""Tidy (long) tables of replays and sweeps: one row per point x layer x metric, settings as columns.

    rows = report.rows()                      # a ReplayReport's rows
    rows = sweep_rows(result)                 # every replayed point's rows, the swept values as columns
    write_csv(rows, "out.csv"); write_parquet(rows, "out.parquet")   # Parquet needs pyarrow

Every row has the same columns, in this order: the settings (`point` and the swept fields for a
sweep; any `settings` given, such as `config_columns`: `pool.expert_slots`, `pool.evict_policy`,
`pool.side_region_slots` and the config's overrides; then `log`, `replay.*`, `cost.*`, `device.*` from the report),
then `layer` (the MoE layer, or "all" for the whole run), `metric` and `value` (a float). A
layer's metrics are its `LayerReport` numbers and `slots`; the run's are the sweep metrics
(`qnpipe.replay.sweep.metrics`), `misses.<cause>` and, with a predictor, `prefetch.<field>`.
Layers absent from the log have no rows (the report lists them in `absent_layers`). A failed
sweep point has no rows (its error is in the sweep's JSON).
"""

from __future__ import annotations

import csv
import importlib
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.config import Config
from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_file, atomic_write
from qnpipe.replay.runner import LayerReport, ReplayReport
from qnpipe.replay.sweep import SweepResult, fmt_value, metrics

# Config settings every exported row carries (the report itself does not hold the config).
CONFIG_COLUMNS = ("pool.expert_slots", "pool.evict_policy", "pool.side_region_slots")
ALL_LAYERS = "all"  # the `layer` of a row about the whole run
LAYER_METRICS = tuple(f for f in LayerReport.__struct_fields__ if f != "layer")
# pyarrow is an optional extra (`pip install qnpipe[parquet]`): tested with these versions.
PYARROW_RANGE = ">=26.0.1,<27"  # pyproject.toml's [parquet] extra


def _cell(v: Any) -> Any:
    """A setting as one table cell: scalars as they are, sequences and mappings as text (a layer set: "0,1,2")."""
    if isinstance(v, list | tuple | dict):
        return fmt_value(v) if not isinstance(v, dict) else msgspec.json.encode(v).decode()
    return v


def report_settings(r: ReplayReport) -> dict[str, Any]:
    """The settings a report records about itself, as columns: its log, predictor and options, cost and device."""
    out: dict[str, Any] = {"log": r.log, "replay.predictor": r.predictor}
    out |= {f"replay.{k}": v for k, v in msgspec.structs.asdict(r.predictor_opts).items()}
    out |= {f"cost.{k}": _cell(v) for k, v in msgspec.structs.asdict(r.cost).items()}
    out |= {f"device.{k}": _cell(v) for k, v in msgspec.structs.asdict(r.device).items()}
    return out


def _run_metrics(r: ReplayReport) -> dict[str, float]:
    out = metrics(r)
    out |= {f"misses.{cause}": float(n) for cause, n in r.misses_by_cause.items()}
    if r.prefetch is not None:
        out |= {f"prefetch.{k}": float(v) for k, v in msgspec.structs.asdict(r.prefetch).items()}
    return out


def report_rows(r: ReplayReport, settings: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The report's rows (see the module doc); `settings` are extra columns (given first, they win on a clash)."""
    cols = {k: _cell(v) for k, v in (settings or {}).items()}
    cols |= {k: v for k, v in report_settings(r).items() if k not in cols}
    rows = [{**cols, "layer": ALL_LAYERS, "metric": m, "value": v} for m, v in _run_metrics(r).items()]
    for x in r.layers:
        values = {m: float(getattr(x, m)) for m in LAYER_METRICS} | {"slots": float(r.capacities[x.layer])}
        rows += [{**cols, "layer": x.layer, "metric": m, "value": v} for m, v in values.items()]
    return rows


def sweep_rows(result: SweepResult, settings: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every replayed point's `report_rows`, led by `point` (its grid index) and the swept fields' values."""
    rows: list[dict[str, Any]] = []
    for p in result.points:
        if p.report is None:
            continue
        cols = {"point": p.index, **p.values}
        rows += report_rows(p.report, cols | {k: v for k, v in (settings or {}).items() if k not in cols})
    return rows


def config_columns(cfg: Config, keys: Iterable[str] = ()) -> dict[str, Any]:
    """Config settings as columns: the pool's capacity, policy and side region, then each of `keys` (dotted)."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys([*CONFIG_COLUMNS, *keys]):
        section, _, name = key.partition(".")
        out[key] = _cell(msgspec.to_builtins(getattr(getattr(cfg, section), name)))
    return out


def to_csv(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """The rows as CSV (a header of the first row's columns; floats in full precision, NaN as "nan")."""
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows({k: ("" if v is None else repr(v) if isinstance(v, float) and math.isfinite(v) else v)
                     for k, v in row.items()} for row in rows)
    return buf.getvalue().encode()


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write `to_csv(rows)` to `path` atomically (qnpipe.io.atomic)."""
    atomic_write(path, to_csv(rows))
    return Path(path)


def pyarrow() -> Any:
    """The pyarrow module, or ConfigError saying how to install it."""
    try:
        return importlib.import_module("pyarrow")
    except ImportError:
        raise ConfigError("--parquet needs pyarrow, an optional extra: pip install 'qnpipe[parquet]' "
                          f"(or pip install 'pyarrow{PYARROW_RANGE}'); --csv needs nothing") from None


def write_parquet(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write the rows to a Parquet file at `path` atomically; `layer` is a string column there ("0", ..., "all")."""
    pa = pyarrow()
    pq = importlib.import_module("pyarrow.parquet")
    table = pa.Table.from_pylist([{**row, "layer": str(row["layer"])} for row in rows])
    with atomic_file(path) as f:
        pq.write_table(table, f)
    return Path(path)


__all__ = ["ALL_LAYERS", "CONFIG_COLUMNS", "LAYER_METRICS", "config_columns", "PYARROW_RANGE", "report_rows", "report_settings", "sweep_rows", "to_csv",
           "write_csv", "write_parquet"]
