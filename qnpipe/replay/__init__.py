"""Replay: a routing log run through the real actors and policies against a simulated device.

    report = qnpipe.replay.replay(log, cfg)

`runner` is the replay itself (deterministic: a `LogBackend` stands in for the model and
`qnpipe.io.simssd` for the SSD; `caveats` words its warnings); `sweep` runs it over a grid of
settings, `sweep_plot` draws the results, `export` turns reports and sweeps into tidy rows
(CSV, Parquet), `mrc` gives the LRU and Belady hit rate at every capacity in one pass (`mrc_export`
writes it as a CSV and a plot), `cost_fit` fits the compute cost model to a recorded log, `synth` writes synthetic
logs, and `model_free`/`belady` are the predictors and the offline bound only replay and the
tools use. Nothing here imports MLX or model code (tests/test_imports.py): a sweep worker
starts in a fraction of a second.
"""

from __future__ import annotations

from qnpipe.replay.belady import belady_hits
from qnpipe.replay.cost_fit import CostFit, CostFitError, fit_cost, load_cost, save_cost
from qnpipe.replay.mrc import Curve, MrcResult, miss_ratio_curves
from qnpipe.replay.runner import (
    DRIVERS,
    PREDICTORS,
    CostModel,
    LayerReport,
    LogBackend,
    Predictions,
    PredictorOpts,
    PrefetchReport,
    ReplayLog,
    ReplayReport,
    describe,
    load_log,
    predictions,
    replay,
    replay_capacities,
    setting_value,
    to_json,
)
from qnpipe.replay.sweep import Axis, Point, PointResult, Settings, SweepResult, parse_grid
from qnpipe.replay.synth import SynthSpec, write_synth

__all__ = [
    "DRIVERS", "PREDICTORS", "CostModel", "LayerReport", "LogBackend", "PredictorOpts", "Predictions", "PrefetchReport",
    "ReplayLog", "ReplayReport", "describe", "load_log", "predictions", "replay", "replay_capacities",
    "setting_value", "to_json",
    # sweep's `run`/`to_json` and synth's `synth` stay in their modules (the names clash or shadow them).
    "Axis", "Point", "PointResult", "Settings", "SweepResult", "parse_grid",
    "CostFit", "CostFitError", "fit_cost", "load_cost", "save_cost", "SynthSpec", "write_synth", "belady_hits",
    "Curve", "MrcResult", "miss_ratio_curves",
]
