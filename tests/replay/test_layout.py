"""replay/'s layout: the fast path loads neither trio nor the actors, the replay modules import each other
without a cycle (function-level imports counted), and the public names stay where they were."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qnpipe

REPLAY = Path(qnpipe.__file__).parent / "replay"
ROOT = Path(qnpipe.__file__).resolve().parents[1]
HEAVY = ("trio", "qnpipe.actors")

# A replay and a serial sweep of a small routing log, in a fresh interpreter; prints which of HEAVY it loaded.
PROBE = """
import json, sys
import qnpipe.replay
from qnpipe import config, trace
from qnpipe.replay import sweep

path = sys.argv[1]
shape = trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, hidden_size=8)
w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="layout", model=shape,
                                         clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes", capacities={}))
for step in range(1, 6):
    for layer in (0, 1):
        w.write(trace.Route(t=0.0, seq=2 * step + layer, step=step, layer=layer, top_k=2,
                            experts=((step + layer) % 8, (step * 3 + 1) % 8)))
w.close(0, 0.0)
cfg = config.load(None, overrides={"pool.expert_slots": 4})
r = qnpipe.replay.replay(path, cfg, record_nbytes=4096, driver=sys.argv[2])
assert r.steps == 5
if sys.argv[2] == "fast":
    points = sweep.plan(path, sweep.parse_grid(["pool.expert_slots=2,4"]), cfg, fixed={"replay.record_nbytes": "4096"})
    assert not sweep.run(path, points, executor="serial").failed
    r.rows()
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)))
"""


def loaded_by_replay(tmp_path: Path, driver: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has loaded after `import qnpipe.replay` and a replay by `driver`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", str(tmp_path / f"{driver}.qtrace"),
                          driver], capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_fast_replay_loads_neither_trio_nor_the_actors(tmp_path: Path) -> None:
    assert loaded_by_replay(tmp_path, "fast") == []


def test_the_check_sees_the_actor_driver_load_them(tmp_path: Path) -> None:
    assert loaded_by_replay(tmp_path, "actors") == sorted(HEAVY)


def sibling_imports(package: Path, name: str) -> dict[str, set[str]]:
    """Each module of `package` (dotted `name`) -> the modules of the package it imports, at any depth of its code."""
    graph: dict[str, set[str]] = {}
    for f in sorted(package.glob("*.py")):
        mod = f"{name}.{f.stem}" if f.stem != "__init__" else name
        out: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            out |= {t for t in targets if t.startswith(name + ".") and t.count(".") == name.count(".") + 1}
        graph[mod] = out - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of `graph` found by a depth-first walk, each once (as first met)."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cyc = path[path.index(nxt):]
                if frozenset(cyc) not in seen:
                    seen.add(frozenset(cyc))
                    found.append([*cyc, nxt])
            elif len(path) < len(graph):
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_replay_modules_import_each_other_without_a_cycle() -> None:
    graph = sibling_imports(REPLAY, "qnpipe.replay")
    graph.pop("qnpipe.replay")  # the package's __init__ gathers its modules' names
    assert cycles(graph) == []
    assert "qnpipe.replay.export" not in graph["qnpipe.replay.runner"] | graph["qnpipe.replay.sweep"]


def test_the_cycle_check_sees_a_function_level_import_back(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("B = 1\n\ndef rows():\n    from pkg.a import A\n    return A\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert cycles(sibling_imports(pkg, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]


# Names that moved out of these modules in the split by job, and must still import from where they were.
MOVED = {
    "qnpipe.replay.runner": ["MAX_COST_S", "MAX_RECORD_NBYTES", "MAX_TABLE_LAYERS", "check_record_nbytes",
                             "setting_value", "CostModel", "LogBackend", "PredictorOpts", "Predictions",
                             "ReplayLog", "LayerReport", "PrefetchReport", "ReplayReport", "belady_total", "describe",
                             "to_json", "load_log", "predictions", "PREDICTORS"],
    "qnpipe.replay.sweep": ["REPLAY_KEYS", "TABLE_METRICS", "Settings", "PointResult", "SweepResult", "replay_keys",
                            "resolve_key", "split_settings", "metric_names", "metrics", "check_metric", "fmt_value",
                            "fmt_metric", "table_metrics", "replay"],
    "qnpipe.replay.export": ["ALL_LAYERS", "LAYER_METRICS", "report_rows", "report_settings", "sweep_rows"],
    "qnpipe.actors.pipeline": ["layer_capacities"],
    "qnpipe.actors": ["layer_capacities"],
    "qnpipe.replay": ["LogBackend"],
}


@pytest.mark.parametrize("module", sorted({*MOVED, "qnpipe.replay.caveats", "qnpipe.replay.cost_fit",
                                           "qnpipe.policy.build"}))
def test_public_names_import_from_where_they_were(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in [*getattr(mod, "__all__", ()), *MOVED.get(module, ())] if not hasattr(mod, n)]
    assert missing == []


def test_layer_capacities_is_one_function_wherever_it_is_imported_from() -> None:
    from qnpipe.actors import layer_capacities as a
    from qnpipe.actors.pipeline import layer_capacities as p
    from qnpipe.policy.build import layer_capacities as b

    assert a is p is b


def test_a_replay_reads_and_parses_its_capacity_profile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qnpipe import config, trace
    from qnpipe.policy import build
    from qnpipe.replay import caveats, replay, runner

    log = tmp_path / "small.qtrace"
    shape = trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, hidden_size=8)
    w = trace.TraceWriter(log, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="layout", model=shape,
                                            clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes",
                                            capacities={}))
    for step in range(1, 4):
        w.write(trace.Route(t=0.0, seq=2 * step, step=step, layer=0, top_k=2, experts=(step % 8, 7)))
        w.write(trace.Route(t=0.0, seq=2 * step + 1, step=step, layer=1, top_k=2, experts=(0, step)))
    w.close(0, 0.0)
    profile = tmp_path / "caps.json"
    profile.write_text('{"layer_caps": {"0": 3, "1": 12}}')  # layer 1 above the 8 experts: a warning from it
    parsed: list[str] = []
    real = runner.parse_capacity_profile

    def once(path: str, data: bytes | str) -> dict[int, int]:
        parsed.append(path)
        return real(path, data)

    def never(path: str) -> dict[int, int]:
        raise AssertionError(f"{path} read a second time")

    monkeypatch.setattr(runner, "parse_capacity_profile", once)
    monkeypatch.setattr(build, "read_capacity_profile", never)
    monkeypatch.setattr(caveats, "read_capacity_profile", never)
    r = replay(log, config.load(None, overrides={"pool.capacity_profile_path": str(profile)}), record_nbytes=64)
    assert parsed == [str(profile)]
    assert r.capacities == {0: 3, 1: 8}
    assert len(r.warnings) == 1 and "(layers 1)" in r.warnings[0]
