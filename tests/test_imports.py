"""Import rules: no module takes another module's _private names, each package imports only what its layer may,
no import runs back up the layers, and qnpipe's modules import each other without cycles.

The rules (RULES, per package; each package's __init__ docstring says the same): qnpipe/config/ imports
nothing of qnpipe but qnpipe.errors and the leaves (LEAVES); qnpipe/policy/ and qnpipe/messages.py no
trio, MLX, qnpipe.io or qnpipe.actors; qnpipe/trace/ and qnpipe/replay/ no MLX and no model or live code;
qnpipe/model/ no trio; qnpipe/convert/ no trio, actors or live engine; qnpipe/io/ no policy, actors or
live engine; and only qnpipe/live/ imports both trio and MLX. LAYERS orders qnpipe's packages and
top-level modules bottom to top: each imports only from its own or a lower layer. The checks read the
source (every import statement, including those inside functions and under `if TYPE_CHECKING:`), so
they hold for modules that do not exist yet the moment they are added.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qnpipe"
# Private modules by name only: the C extensions (a Python fallback stands beside each) and the version.
PRIVATE_OK = {"qnpipe.io._preadx", "qnpipe.policy._slot_table", "qnpipe._version"}

# Leaves below every layer: they import nothing of qnpipe but errors, so the config modules may read
# TOML through qnpipe.files (read a small file whole, capped and regular-only).
LEAVES = {"qnpipe.files", "qnpipe._version"}
MLX = ("mlx", "mlx_lm")
RULES: dict[str, tuple[str, ...]] = {
    "qnpipe/policy/": ("trio", *MLX, "qnpipe.io", "qnpipe.actors"),
    "qnpipe/messages.py": ("trio", *MLX, "qnpipe.io", "qnpipe.actors"),
    "qnpipe/trace/": (*MLX, "qnpipe.model", "qnpipe.live"),
    "qnpipe/replay/": (*MLX, "qnpipe.model", "qnpipe.live"),
    "qnpipe/model/": ("trio",),
    "qnpipe/convert/": ("trio", "qnpipe.actors", "qnpipe.live"),
    "qnpipe/io/": ("qnpipe.policy", "qnpipe.actors", "qnpipe.live"),
}
# Packages that import nothing of qnpipe but themselves, these and the leaves.
ONLY: dict[str, tuple[str, ...]] = {"qnpipe/config/": ("qnpipe.config", "qnpipe.errors")}
# The one package where trio and MLX meet: everywhere else a module is on one side of the MLX thread.
BOTH = ("trio", "mlx")
BOTH_OK = "qnpipe/live/"


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) for each import; `import a.b` gives names []."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def private_imports(rel: str, text: str) -> list[str]:
    """Each `from qnpipe.x import _y` (or `import qnpipe._x`) in one module's source."""
    hits = []
    for line, module, names in _imports(ast.parse(text)):
        if not module.startswith("qnpipe"):
            continue
        full = [f"{module}.{n}" for n in names] or [module]
        for f in full:
            if f not in PRIVATE_OK and module not in PRIVATE_OK and any(part.startswith("_") and not part.startswith("__")
                                           for part in f.split(".")):
                hits.append(f"{rel}:{line}: {f}")
    return hits


def layering_violations(rel: str, text: str) -> list[str]:
    """Each import of `rel` (a path under the repository) that its package's rules forbid."""
    banned = [b for prefix, bs in RULES.items() if rel.startswith(prefix) for b in bs]
    only = [a for prefix, allowed in ONLY.items() if rel.startswith(prefix) for a in allowed]
    imports = _imports(ast.parse(text))
    hits = []
    for line, module, _ in imports:
        if module in LEAVES:
            continue
        for b in banned:
            if module == b or module.startswith(b + "."):
                hits.append(f"{rel}:{line}: imports {module} (forbidden here: {b})")
        if only and module.startswith("qnpipe") and not any(module == a or module.startswith(a + ".") for a in only):
            hits.append(f"{rel}:{line}: imports {module} (only {', '.join(only)} and the leaves here)")
    return hits


# qnpipe's packages and top-level modules, bottom to top. A module imports from its own package or
# module and from lower layers only: never from its own layer's others (they stand side by side) nor
# from above. A new top-level module or package is placed here when it is added.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("qnpipe.errors", "qnpipe._version", "qnpipe.steps", "qnpipe.mtp_stats"),
    ("qnpipe.files", "qnpipe.messages", "qnpipe.builtin_models"),  # builtin_models: names of the shipped model's path
    ("qnpipe.config",),
    ("qnpipe.io", "qnpipe.compute"),
    ("qnpipe.trace", "qnpipe.chat", "qnpipe.stats"),
    ("qnpipe.policy", "qnpipe.model"),
    ("qnpipe.stats_snapshot", "qnpipe.stats_lines"),  # the pipeline's figures: the pool policy's snapshot in, the public stats out
    ("qnpipe.hang_guard", "qnpipe.actors"),
    ("qnpipe.replay", "qnpipe.convert"),
    ("qnpipe.plan",),
    ("qnpipe.live", "qnpipe.engine_args"),  # engine_args: what Engine is given, made a Config
    ("qnpipe.engine",),
    ("qnpipe.embed",),  # the engine's old name, kept importable
    ("qnpipe.server",),
    ("qnpipe.cli",),
    ("qnpipe", "qnpipe.__main__"),
)
_RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str | None:
    """The LAYERS entry `module` belongs to (None: a qnpipe module no layer names)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "qnpipe" if module == "qnpipe" else None
    return ".".join(parts[:2]) if ".".join(parts[:2]) in _RANK else None


def upward_imports(rel: str, text: str) -> list[str]:
    """Each import of `rel` (a path under the repository) from its own layer's others or a higher layer."""
    unit = _unit(_module_name(rel))
    if unit is None:
        return [f"{rel}: in no layer (add it to LAYERS)"]
    hits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [(a.name, _unit(a.name)) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "qnpipe" and node.level == 0:
            # `from qnpipe import x`: module x's layer, else a name of the package root.
            targets = [(f"qnpipe.{a.name}", _unit(f"qnpipe.{a.name}") or "qnpipe") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [(node.module, _unit(node.module))]
        else:
            continue
        for m, to in targets:
            if not (m == "qnpipe" or m.startswith("qnpipe.")):
                continue
            if to != unit and (to is None or _RANK[to] >= _RANK[unit]):
                where = "its own layer" if to is not None and _RANK[to] == _RANK[unit] else "a higher layer"
                hits.append(f"{rel}:{node.lineno}: imports {m} ({where}: {to} over {unit})")
    return hits


def test_no_import_runs_back_up_the_layers() -> None:
    sources = _sources("qnpipe")
    hits = [h for rel, text in sources.items() for h in upward_imports(rel, text)]
    assert not hits, "\n".join(hits)
    assert {_unit(_module_name(rel)) for rel in sources} == set(_RANK)  # every layer entry exists


def test_the_layer_rule_catches_violations() -> None:
    assert upward_imports("qnpipe/plan/ranks.py", "from qnpipe.live.parallel.split import split_layers\n") == [
        "qnpipe/plan/ranks.py:1: imports qnpipe.live.parallel.split (a higher layer: qnpipe.live over qnpipe.plan)"]
    # Inside a function and under TYPE_CHECKING too; `from qnpipe import x` names its module.
    lazy = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qnpipe.model.args import ModelArgs\n"
            "def f():\n    from qnpipe import __version__, config\n")
    assert upward_imports("qnpipe/io/store_check.py", lazy) == [
        "qnpipe/io/store_check.py:3: imports qnpipe.model.args (a higher layer: qnpipe.model over qnpipe.io)",
        "qnpipe/io/store_check.py:5: imports qnpipe.__version__ (a higher layer: qnpipe over qnpipe.io)"]
    assert upward_imports("qnpipe/messages.py", "from qnpipe.policy.read_queue import ReadClass\n") != []
    assert upward_imports("qnpipe/trace/timeline.py", "from qnpipe.chat.template import render\n") == [
        "qnpipe/trace/timeline.py:1: imports qnpipe.chat.template (its own layer: qnpipe.chat over qnpipe.trace)"]
    assert upward_imports("qnpipe/newthing.py", "import os\n") == ["qnpipe/newthing.py: in no layer (add it to LAYERS)"]
    assert upward_imports("qnpipe/cli/run.py", "from qnpipe.server.run import serve\nimport qnpipe.config\n") == []
    assert upward_imports("qnpipe/policy/eviction.py", "from qnpipe.policy.eviction_plugin import make_plugin\n") == []


def trio_and_mlx(rel: str, text: str) -> list[str]:
    """`rel`, when it imports both trio and MLX outside qnpipe/live/."""
    tops = {m.split(".")[0] for _, m, _ in _imports(ast.parse(text))}
    if set(BOTH) <= tops and not rel.startswith(BOTH_OK):
        return [f"{rel}: imports both trio and mlx (only {BOTH_OK} may)"]
    return []


def _sources(*dirs: str) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for d in dirs for p in sorted((ROOT / d).rglob("*.py"))}


def test_no_module_imports_another_modules_private_names() -> None:
    hits = [h for rel, text in _sources("qnpipe", "tools", "tests").items() for h in private_imports(rel, text)]
    assert not hits, "give these a public name:\n" + "\n".join(hits)


def test_layering() -> None:
    sources = _sources("qnpipe")
    hits = [h for rel, text in sources.items() for h in layering_violations(rel, text)]
    assert not hits, "\n".join(hits)
    assert any(rel.startswith("qnpipe/model/") for rel in sources)  # the rules saw the real tree


def test_only_the_live_engine_imports_both_trio_and_mlx() -> None:
    sources = _sources("qnpipe")
    hits = [h for rel, text in sources.items() for h in trio_and_mlx(rel, text)]
    assert not hits, "\n".join(hits)
    assert any(rel.startswith(BOTH_OK) for rel in sources)


def test_leaves_import_nothing_of_qnpipe_but_errors() -> None:
    for leaf in LEAVES:
        rel = leaf.replace(".", "/") + ".py"
        mods = {m for _, m, _ in _imports(ast.parse((ROOT / rel).read_text(encoding="utf-8")))}
        assert {m for m in mods if m.startswith("qnpipe")} <= {"qnpipe.errors"}, rel


def test_the_checks_catch_violations() -> None:
    bad = "from qnpipe.convert.safetensors_out import _Job, write_safetensors\nimport qnpipe._hidden\nimport qnpipe.config\n"
    assert private_imports("qnpipe/x.py", bad) == [
        "qnpipe/x.py:1: qnpipe.convert.safetensors_out._Job", "qnpipe/x.py:2: qnpipe._hidden"]
    assert private_imports("qnpipe/x.py", "from qnpipe.io import _preadx\nfrom qnpipe._version import __version__\n") == []
    assert private_imports("qnpipe/x.py", "from qnpipe import _preadx\n") == ["qnpipe/x.py:1: qnpipe._preadx"]
    policy = "import trio\n\ndef f():\n    import mlx.core as mx\n    from qnpipe.io.store import ExpertStore\n"
    assert layering_violations("qnpipe/policy/eviction.py", policy) == [
        "qnpipe/policy/eviction.py:1: imports trio (forbidden here: trio)",
        "qnpipe/policy/eviction.py:4: imports mlx.core (forbidden here: mlx)",
        "qnpipe/policy/eviction.py:5: imports qnpipe.io.store (forbidden here: qnpipe.io)",
    ]
    assert layering_violations("qnpipe/model/pool_view.py", "import trio\nimport mlx.core\n") == [
        "qnpipe/model/pool_view.py:1: imports trio (forbidden here: trio)"]
    assert layering_violations("qnpipe/messages.py", "import msgspec\nimport trio_typing\n") == []
    assert layering_violations("qnpipe/actors/pool.py", "import trio\nimport mlx.core\n") == []


def test_the_package_rules_catch_violations() -> None:
    config = "import msgspec\nfrom qnpipe.errors import ConfigError\nfrom qnpipe.files import read_capped\n" \
             "from qnpipe.config.tree import Config\nfrom qnpipe.io.store import ExpertStore\n" \
             "def f():\n    from qnpipe.policy.pool import PoolPolicy\n"
    assert layering_violations("qnpipe/config/loader.py", config) == [
        "qnpipe/config/loader.py:5: imports qnpipe.io.store (only qnpipe.config, qnpipe.errors and the leaves here)",
        "qnpipe/config/loader.py:7: imports qnpipe.policy.pool (only qnpipe.config, qnpipe.errors and the leaves here)",
    ]
    assert layering_violations("qnpipe/policy/pool.py", "from qnpipe.actors.pool import pool\n") == [
        "qnpipe/policy/pool.py:1: imports qnpipe.actors.pool (forbidden here: qnpipe.actors)"]
    for pkg in ("trace", "replay"):
        rel = f"qnpipe/{pkg}/x.py"
        assert layering_violations(rel, "import trio\nimport mlx.core as mx\nfrom mlx_lm import load\n"
                                        "from qnpipe.model.stepper import MlxBackend\n") == [
            f"{rel}:2: imports mlx.core (forbidden here: mlx)", f"{rel}:3: imports mlx_lm (forbidden here: mlx_lm)",
            f"{rel}:4: imports qnpipe.model.stepper (forbidden here: qnpipe.model)"]
    assert layering_violations("qnpipe/convert/build.py", "import mlx.core\nimport trio\n") == [
        "qnpipe/convert/build.py:2: imports trio (forbidden here: trio)"]
    assert layering_violations("qnpipe/io/store.py", "from qnpipe.live.loaded import LoadedModel\n") == [
        "qnpipe/io/store.py:1: imports qnpipe.live.loaded (forbidden here: qnpipe.live)"]
    assert layering_violations("qnpipe/io/device.py", "def f():\n    from qnpipe.policy.read_queue import Job\n") == [
        "qnpipe/io/device.py:2: imports qnpipe.policy.read_queue (forbidden here: qnpipe.policy)"]
    assert layering_violations("qnpipe/io/device.py", "from qnpipe.messages import Job\n") == []
    both = "import trio\n\ndef f():\n    import mlx.core as mx\n"
    assert trio_and_mlx("qnpipe/engine.py", both) == ["qnpipe/engine.py: imports both trio and mlx (only qnpipe/live/ may)"]
    assert trio_and_mlx("qnpipe/actors/pool.py", both) != []
    assert trio_and_mlx("qnpipe/live/loaded.py", both) == []
    assert trio_and_mlx("qnpipe/model/stepper.py", "import mlx.core\nimport numpy\n") == []


# What replay, sweeps and the trace tools load: the actors and policies, never the model code
# (mlx-lm pulls in transformers: ~1.4 s of start-up per process, paid by every sweep worker).
MODEL_FREE = ("qnpipe.replay", "qnpipe.replay.sweep", "qnpipe.replay.cost_fit", "qnpipe.actors.pipeline",
              "qnpipe.trace", "qnpipe.cli.replay_cmd", "qnpipe.cli.sweep_cmd", "qnpipe.cli.trace_cmd")
HEAVY = ("mlx", "mlx_lm", "transformers", "qnpipe.live.loaded", "qnpipe.model.stepper", "qnpipe.model.qwen3_next")


@pytest.mark.slow
def test_replay_and_sweeps_load_no_model_code() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {MODEL_FREE!r}:\n    importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # The check itself sees these modules when they are loaded.
    live = subprocess.run([sys.executable, "-c", code.replace("for m in", "import qnpipe.live.loaded\nfor m in", 1)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "qnpipe.live.loaded" in json.loads(live.stdout.strip().splitlines()[-1])


def _module_name(rel: str) -> str:
    name = rel.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


# Modules heavy enough (they load MLX or mlx-lm) that their users import them inside a function, at
# the moment they are needed. Such a lazy import is not an edge of the cycle check: it cannot meet a
# half-initialised module, and it is how a light module reaches a heavy one on demand. (The layer
# rule below still counts it: a lazy import may not run back up either.)
LAZY_OK = {"qnpipe.engine", "qnpipe.model.kvquant"}

# Cycles other branches of the same change remove (issue 35): the lead drops an entry at merge, when
# test_no_import_cycles says it is gone.
KNOWN_CYCLES: list[set[str]] = []


def module_imports(text: str, modules: set[str]) -> set[str]:
    """The qnpipe modules a module's source imports, anywhere in it.

    The module's body counts, with its class bodies and `if`/`try` blocks, `if TYPE_CHECKING:`
    included (such an import never runs, but it is still an arrow of the design: policy/heat <->
    policy/pool was one), and so do function bodies (a lazy import is an arrow too:
    policy/eviction <-> eviction_plugin was one), except a lazy import of a LAZY_OK module.
    `from a import b` is an edge to `a.b` when that is a module, else to `a` (its __init__ has
    to have bound `b` already). The implicit import of a module's parent package is not an edge: a
    package __init__ that re-exports its submodules is the normal case, and Python binds a
    submodule under a package still being initialised.
    """
    out: set[str] = set()

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if not (lazy and a.name in LAZY_OK))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                target = full if full in modules else node.module
                if not (lazy and target in LAZY_OK):
                    out.add(target)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(text), False)
    return {m for m in out if m in modules}


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """Each cycle of load-time imports among `sources` (path -> text), as a list of modules, first repeated last."""
    names = {_module_name(rel): text for rel, text in sources.items()}
    graph = {m: sorted(module_imports(text, set(names))) for m, text in names.items()}
    cycles, done, path = [], set(), []

    def walk(m: str) -> None:
        if m in path:
            cycles.append([*path[path.index(m):], m])
            return
        if m in done:
            return
        path.append(m)
        for n in graph[m]:
            walk(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        walk(m)
    return cycles


def test_no_import_cycles() -> None:
    sources = _sources("qnpipe")
    cycles = import_cycles(sources)
    assert [c for c in cycles if not any(set(c) <= known for known in KNOWN_CYCLES)] == []
    gone = [known for known in KNOWN_CYCLES if not any(set(c) <= known for c in cycles)]
    assert gone == [], f"no longer cycles: remove them from KNOWN_CYCLES: {gone}"
    assert len(sources) > 100  # the check saw the real tree


def test_lazy_ok_names_heavy_modules_imported_lazily() -> None:
    """Each LAZY_OK module exists, loads MLX (or mlx-lm) at import, and some module imports it in a function."""
    sources = _sources("qnpipe")
    names = {_module_name(rel): text for rel, text in sources.items()}
    lazy_targets = set()
    for text in names.values():
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                lazy_targets |= {m for _, m, _ in _imports(fn)}
    for m in LAZY_OK:
        assert m in names and m in lazy_targets, m
        assert any(i.split(".")[0] in MLX or i in HEAVY for i in load_time_imports_of(names[m])), m


def load_time_imports_of(text: str) -> set[str]:
    """Every module a source imports outside its functions (what loading it loads)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(text))
    return out


def test_the_cycle_check_catches_a_cycle() -> None:
    fake = {
        "qnpipe/policy/pool.py": "from qnpipe.policy.heat import Heat\n",
        "qnpipe/policy/heat.py": "import attrs\nfrom qnpipe.policy.pool import PoolPolicy\n",
        "qnpipe/policy/__init__.py": "from qnpipe.policy.pool import PoolPolicy\n",
    }
    assert import_cycles(fake) == [["qnpipe.policy.pool", "qnpipe.policy.heat", "qnpipe.policy.pool"]]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qnpipe.policy.pool import PoolPolicy\n"
    assert import_cycles({**fake, "qnpipe/policy/heat.py": typing_only}) != []
    # Inside a function too (a lazy import is an arrow of the design), and in a method.
    late = "def f():\n    from qnpipe.policy.pool import PoolPolicy\n"
    assert import_cycles({**fake, "qnpipe/policy/heat.py": late}) == [
        ["qnpipe.policy.pool", "qnpipe.policy.heat", "qnpipe.policy.pool"]]
    method = "class H:\n    async def f(self):\n        import qnpipe.policy.pool\n"
    assert import_cycles({**fake, "qnpipe/policy/heat.py": method}) != []
    # ...but not a lazy import of a heavy module LAZY_OK names (that module may import its user).
    heavy = {"qnpipe/__init__.py": "def __getattr__(name):\n    from qnpipe import engine\n",
             "qnpipe/engine.py": "import mlx.core\nfrom qnpipe import __version__\n"}
    assert import_cycles(heavy) == []
    assert import_cycles({**heavy, "qnpipe/__init__.py": "from qnpipe import engine\n"}) == [
        ["qnpipe", "qnpipe.engine", "qnpipe"]]
    # A submodule importing a name from its own package's __init__, which imports that submodule.
    pkg = {"qnpipe/trace/__init__.py": "from qnpipe.trace.stats import trace_stats\n",
           "qnpipe/trace/stats.py": "from qnpipe.trace import read\n"}
    assert import_cycles(pkg) == [["qnpipe.trace", "qnpipe.trace.stats", "qnpipe.trace"]]
