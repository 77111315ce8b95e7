"""The public names: `qnpipe.__all__` and each package's `__all__` are pinned here, so a name cannot leave
(or arrive) unseen in a restructuring; every pinned name resolves on its package (lazy ones included).

A package that exports nothing has no `__all__` and is pinned as (). Adding a public name is a
change of this table in the same commit; removing one keeps it importable from its old path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PUBLIC: dict[str, tuple[str, ...]] = {
    "qnpipe": ("Config", "Engine", "__version__", "config", "open_engine"),
    "qnpipe.actors": ("Autopin", "Backend", "Emitter", "Forward", "ForwardStats", "Pipeline", "RecorderStats",
                      "layer_capacities", "make_policy", "open_pipeline", "open_recording"),
    "qnpipe.chat": (),
    "qnpipe.cli": ("COMMANDS", "DEMO_MODEL_DIR", "build_parser", "main"),
    "qnpipe.compute": (),
    "qnpipe.config": (
        "ChatCfg", "ComputeCfg", "Config", "ConfigError", "DiagCfg", "EvictPolicy", "FieldSpec", "ForwardCfg",
        "HiddenVariant", "KvCfg", "LEGACY_NAMES", "MemoryCfg", "ModelCfg", "ModelTier", "MtpCfg", "MtpHidden", "MtpVerifyMode",
        "NOT_YET_IMPLEMENTED", "NotImplementedConfigWarning", "OVERRIDE_ALIASES", "PoolCfg", "PredictAgg",
        "PredictCfg", "PrefetchInto", "PrefixCfg", "ReadBackend", "ReadCfg", "ReplacedSwitchWarning", "TraceCfg",
        "check_evict_policy", "describe_allowed", "explicit_settings", "field_specs", "format_layer_set", "load",
        "override_path", "parse_layer_set", "rebuilt", "with_overrides"),
    "qnpipe.convert": ("CHUNK_BYTES", "ConvertReport", "MAX_SHARD_BYTES", "MODEL_FORMAT", "MODEL_VERSION",
                       "ROW_BLOCK_BYTES", "VerifyReport", "convert", "make_tiny", "verify_store"),
    "qnpipe.io": ("CacheMode", "DeviceProfile", "ExpertDevice", "ExpertReader", "ExpertStore", "ReadRequest",
                  "ReadResult", "ReaderStats", "SimSSD", "SimStats", "SsdReader", "StoreDevice", "atomic_file",
                  "atomic_write", "check_regular", "open_simssd", "read_capped", "read_index", "write_index"),
    "qnpipe.live": ("LoadedModel", "MLXThread", "Output", "PrefixCache", "SnapshotFileWarning", "Streaming",
                    "ThreadedBackend", "generate", "generate_stats", "load_model", "logits", "next_logits",
                    "open_model_pipeline", "resume", "run_on"),
    "qnpipe.live.parallel": (),
    "qnpipe.live.mtp": (),
    "qnpipe.model": ("LoadedModel", "MemoryLimitWarning", "MlxBackend", "ModelArgs", "Runner",
                     "apply_memory_limits", "args_from_dict", "config_model_id", "load_model", "model_id",
                     "read_config"),
    "qnpipe.model.family": ("FamilyInfo", "SwitchSite", "build_skeleton", "family_info", "find_switches"),
    "qnpipe.plan": ("Account", "Candidate", "Line", "ModelFacts", "Plan", "capacity_profile", "fmt_bytes",
                    "load_plan", "make_plan", "make_plans", "minimum_budget", "model_facts", "parse_memory",
                    "plan_overrides", "replay_plan", "resolve_device", "save_plan", "shape_facts"),
    "qnpipe.policy": (
        "ARC", "AcquirePlan", "Clock", "Eviction", "FIFO", "Grant", "Heat", "HintFate", "Job", "LFU", "LRFU", "LRU",
        "LayerCounters", "Load", "LoadCause", "MissCause", "MissKind", "PoolPolicy", "PrefetchBudgets", "ReadClass", "ReadQueue",
        "S3FIFO", "Sieve", "SlotState", "SlotTable", "autopin_plan", "hint_top", "make_eviction", "pin_budget",
        "plan_parts", "predict_targets", "rank"),
    "qnpipe.replay": (
        "Axis", "CostFit", "CostFitError", "CostModel", "Curve", "DRIVERS", "LayerReport", "LogBackend", "MrcResult",
        "PREDICTORS", "Point", "PointResult", "Predictions", "PredictorOpts", "PrefetchReport", "ReplayLog",
        "ReplayReport", "Settings", "SweepResult", "SynthSpec", "belady_hits", "describe", "fit_cost", "load_cost",
        "load_log", "miss_ratio_curves", "parse_grid", "predictions", "replay", "replay_capacities", "save_cost",
        "setting_value", "to_json", "write_synth"),
    "qnpipe.server": (),
    "qnpipe.trace": (
        "Candidates", "Compute", "CrossLayerStats", "Evicted", "FORMATS", "Footer", "Header", "ImportSummary",
        "LayerStats", "MAGIC", "MAX_EXPERTS", "MAX_FRAME", "MAX_HIDDEN", "MAX_LAYERS", "ModelShape", "PrefetchHint",
        "Read", "ReadStarted", "RecallSample", "Record", "RequestStart", "Route", "SCHEMA_VERSION", "SpecRound",
        "Stall", "Stalled", "TRACE_CAP", "Timeline", "TraceStats", "TraceWriter", "UnionSize", "canonical",
        "check_header", "check_log_paths", "check_output_path", "draw", "import_log", "iter_records", "read",
        "read_all", "route_record", "trace_stats"),
    "qnpipe.trace.importers": ("FORMATS", "ImportSummary", "KNOWN_SHAPES", "MAX_BYTES", "SUFFIXES", "ShapeOverride",
                               "describe", "import_log", "known_shape", "sources"),
}


def api_drift(pinned: dict[str, tuple[str, ...]], actual: dict[str, list[str]]) -> list[str]:
    """Each package whose `__all__` differs from its pin (names gone, names new), and each package not pinned
    or pinned but gone."""
    out = []
    for pkg in sorted(pinned.keys() | actual.keys()):
        if pkg not in actual:
            out.append(f"{pkg}: pinned, but no such package")
        elif pkg not in pinned:
            out.append(f"{pkg}: a package not pinned in PUBLIC (its __all__: {sorted(actual[pkg])})")
        else:
            gone, new = sorted(set(pinned[pkg]) - set(actual[pkg])), sorted(set(actual[pkg]) - set(pinned[pkg]))
            if gone or new or len(actual[pkg]) != len(set(actual[pkg])):
                out.append(f"{pkg}: gone {gone}, new {new}" + (" (listed twice)" if not (gone or new) else ""))
    return out


def _packages() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / "qnpipe").rglob("__init__.py"))


def test_every_package_exports_what_is_pinned_and_every_name_resolves() -> None:
    # In a child: resolving `qnpipe.Engine` loads MLX after putting a BLAS in front of it.
    code = ("import importlib, json, sys\nout = {}\n"
            f"for p in {_packages()!r}:\n"
            "    m = importlib.import_module(p)\n"
            "    names = list(getattr(m, '__all__', []))\n"
            "    out[p] = [names, [n for n in names if not hasattr(m, n)]]\n"
            "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert api_drift(PUBLIC, {pkg: names for pkg, (names, _) in got.items()}) == []
    assert {pkg: missing for pkg, (_, missing) in got.items() if missing} == {}


def test_the_pin_catches_drift() -> None:
    pinned = {"qnpipe": ("Config", "Engine"), "qnpipe.io": ("read_capped",), "qnpipe.gone": ()}
    actual = {"qnpipe": ["Config", "Engine"], "qnpipe.io": ["read_capped_v2"], "qnpipe.new": ["x"]}
    assert api_drift(pinned, actual) == [
        "qnpipe.gone: pinned, but no such package",
        "qnpipe.io: gone ['read_capped'], new ['read_capped_v2']",
        "qnpipe.new: a package not pinned in PUBLIC (its __all__: ['x'])",
    ]
    assert api_drift(pinned | {"qnpipe.gone": ()}, actual | {"qnpipe.gone": [], "qnpipe.io": ["read_capped"],
                                                              "qnpipe.new": []}) == [
        "qnpipe.new: a package not pinned in PUBLIC (its __all__: [])"]
    assert api_drift({"qnpipe": ("a",)}, {"qnpipe": ["a", "a"]}) == ["qnpipe: gone [], new [] (listed twice)"]


def test_old_engine_module_name_still_imports() -> None:
    """`qnpipe.embed` was the engine's module before `qnpipe.engine`: scripts that import it keep working."""
    import qnpipe.embed
    import qnpipe.engine

    assert qnpipe.embed.Engine is qnpipe.engine.Engine
    assert qnpipe.embed.open_engine is qnpipe.engine.open_engine


def test_old_live_names_still_resolve() -> None:
    """`Core`, `build_core` and `open_core_pipeline` were renamed (a `Core` beside PoolCore/ReadCore misled)."""
    import qnpipe.live as live

    assert live.Core is live.LoadedModel
    assert live.build_core is live.load_model
    assert live.open_core_pipeline is live.open_model_pipeline
