"""Tidy (long) tables of replays and sweeps: one row per point x layer x metric, settings as columns.

    rows = report.rows()                      # a ReplayReport's rows
    rows = sweep_rows(result)                 # every replayed point's rows, the swept values as columns
    write_csv(rows, "out.csv"); write_parquet(rows, "out.parquet")   # Parquet needs pyarrow

Every row has the same columns, in this order: the settings (`point` and the swept fields for a
sweep; any `settings` given, such as `config_columns`: `pool.expert_slots`, `pool.evict_policy`,
`pool.side_region_slots` and the config's overrides; then `log`, `replay.*`, `cost.*`, `device.*` from the report),
then `layer` (the MoE layer, or "all" for the whole run), `metric` and `value` (a float). A
layer's metrics are its `LayerReport` numbers and `slots`; the run's are the sweep metrics
(`qnpipe.replay.report.metrics`), `misses.<cause>` and, with a predictor, `prefetch.<field>`.
Layers absent from the log have no rows (the report lists them in `absent_layers`). A failed
sweep point has no rows (its error is in the sweep's JSON). The rows are built beside the types they
come from (qnpipe.replay.report, qnpipe.replay.sweep_result: `report.rows()` needs no import back up);
this module adds the config's columns and writes the files.
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
from qnpipe.replay.report import ALL_LAYERS, LAYER_METRICS, cell, report_rows, report_settings
from qnpipe.replay.sweep_result import sweep_rows

# Config settings every exported row carries (the report itself does not hold the config).
CONFIG_COLUMNS = ("pool.expert_slots", "pool.evict_policy", "pool.side_region_slots")
# pyarrow is an optional extra (`pip install qnpipe[parquet]`): tested with these versions.
PYARROW_RANGE = ">=26.0.1,<27"  # pyproject.toml's [parquet] extra


def config_columns(cfg: Config, keys: Iterable[str] = ()) -> dict[str, Any]:
    """Config settings as columns: the pool's capacity, policy and side region, then each of `keys` (dotted)."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys([*CONFIG_COLUMNS, *keys]):
        section, _, name = key.partition(".")
        out[key] = cell(msgspec.to_builtins(getattr(getattr(cfg, section), name)))
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
