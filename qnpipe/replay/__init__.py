"""Replay: a routing log run through the real policies against a simulated device, in virtual time.

    report = qnpipe.replay.replay(log, cfg)

`runner` is the replay itself (deterministic: the log's routes stand in for the model and a
simulated device for the SSD), by one of two drivers giving the same report: `fast` (the default:
the cores on a plain event loop) or `actor_driver` (`driver="actors"`: the live trio actors, where a
`LogBackend` is the model; only it loads trio and qnpipe.actors). `log` reads the log, `cost` models
the compute, `predictors` computes the hints, `settings` reads the replay's own settings from text,
`report` holds the report, its text and its rows, `caveats` words its warnings. `sweep` runs the
replay over a grid of settings (`sweep_result` holds what comes back), `sweep_plot` draws the
results, `export` turns reports and sweeps into tidy rows
(CSV, Parquet), `mrc` gives the LRU and Belady hit rate at every capacity in one pass (`mrc_export`
writes it as a CSV and a plot), `cost_fit` fits the compute cost model to a recorded log, `synth` writes synthetic
logs, and `model_free`/`belady` are the predictors and the offline bound only replay and the
tools use. Nothing here imports MLX or model code (tests/test_imports.py): a sweep worker
starts in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qnpipe.replay.belady import belady_hits
from qnpipe.replay.cost_fit import CostFit, CostFitError, fit_cost, load_cost, save_cost
from qnpipe.replay.mrc import Curve, MrcResult, miss_ratio_curves
from qnpipe.replay.runner import (
    DRIVERS,
    PREDICTORS,
    CostModel,
    LayerReport,
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

if TYPE_CHECKING:
    from qnpipe.replay.actor_driver import LogBackend

__all__ = [
    "DRIVERS", "PREDICTORS", "CostModel", "LayerReport", "LogBackend", "PredictorOpts", "Predictions", "PrefetchReport",
    "ReplayLog", "ReplayReport", "describe", "load_log", "predictions", "replay", "replay_capacities",
    "setting_value", "to_json",
    # sweep's `run`/`to_json` and synth's `synth` stay in their modules (the names clash or shadow them).
    "Axis", "Point", "PointResult", "Settings", "SweepResult", "parse_grid",
    "CostFit", "CostFitError", "fit_cost", "load_cost", "save_cost", "SynthSpec", "write_synth", "belady_hits",
    "Curve", "MrcResult", "miss_ratio_curves",
]


def __getattr__(name: str) -> Any:
    if name == "LogBackend":  # the actor driver's, loaded on first use: it brings trio and the actors
        from qnpipe.replay.actor_driver import LogBackend

        return LogBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
