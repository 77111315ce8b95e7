"""Import rules: no module takes another module's _private names, and the layering of style.md §7.1.

Layering: qnpipe/policy/, qnpipe/messages.py, qnpipe/ids.py and the config modules import
neither trio nor mlx nor qnpipe.io; qnpipe/model/ never imports trio. Both checks read the
source (every import statement, including those inside functions), so they hold for modules
that do not exist yet the moment they are added.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qnpipe"
# The C extension is a private module by name only (the Python fallback stands beside it).
PRIVATE_OK = {"qnpipe._preadx"}

PURE = ("qnpipe/policy/", "qnpipe/messages.py", "qnpipe/ids.py", "qnpipe/config/loader.py", "qnpipe/config/tree.py",
        "qnpipe/config/aliases.py", "qnpipe/config/pending.py")
# qnpipe.io.files (read a small file whole, capped and regular-only) is a leaf below every
# layer: it imports nothing of qnpipe but errors, so the config modules may read TOML through it.
LEAVES = {"qnpipe.io.files"}
RULES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(PURE, ("trio", "mlx", "qnpipe.io")),
    "qnpipe/model/": ("trio",),
}


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
            if f not in PRIVATE_OK and any(part.startswith("_") and not part.startswith("__")
                                           for part in f.split(".")):
                hits.append(f"{rel}:{line}: {f}")
    return hits


def layering_violations(rel: str, text: str) -> list[str]:
    """Each import of `rel` that its layer forbids (RULES)."""
    banned = [b for prefix, bs in RULES.items() if rel.startswith(prefix) or rel == prefix for b in bs]
    hits = []
    for line, module, _ in _imports(ast.parse(text)):
        if module in LEAVES:
            continue
        for b in banned:
            if module == b or module.startswith(b + "."):
                hits.append(f"{rel}:{line}: imports {module} (forbidden here: {b})")
    return hits


def _sources(*dirs: str) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for d in dirs for p in sorted((ROOT / d).rglob("*.py"))}


def test_no_module_imports_another_modules_private_names() -> None:
    hits = [h for rel, text in _sources("qnpipe", "tools").items() for h in private_imports(rel, text)]
    assert not hits, "give these a public name:\n" + "\n".join(hits)


def test_layering() -> None:
    sources = _sources("qnpipe")
    hits = [h for rel, text in sources.items() for h in layering_violations(rel, text)]
    assert not hits, "\n".join(hits)
    assert any(rel.startswith("qnpipe/model/") for rel in sources)  # the rules saw the real tree


def test_leaves_import_nothing_of_qnpipe_but_errors() -> None:
    for leaf in LEAVES:
        rel = leaf.replace(".", "/") + ".py"
        mods = {m for _, m, _ in _imports(ast.parse((ROOT / rel).read_text(encoding="utf-8")))}
        assert {m for m in mods if m.startswith("qnpipe")} <= {"qnpipe.errors"}, rel


def test_the_checks_catch_violations() -> None:
    bad = "from qnpipe.convert.safetensors_out import _Job, write_safetensors\nimport qnpipe._hidden\nimport qnpipe.config\n"
    assert private_imports("qnpipe/x.py", bad) == [
        "qnpipe/x.py:1: qnpipe.convert.safetensors_out._Job", "qnpipe/x.py:2: qnpipe._hidden"]
    assert private_imports("qnpipe/x.py", "from qnpipe import _preadx\n") == []
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


# What replay, sweeps and the trace tools load: the actors and policies, never the model code
# (mlx-lm pulls in transformers: ~1.4 s of start-up per process, paid by every sweep worker).
MODEL_FREE = ("qnpipe.replay", "qnpipe.replay.sweep", "qnpipe.replay.cost_fit", "qnpipe.actors.pipeline", "qnpipe.cli.replay_cmd",
              "qnpipe.cli.sweep_cmd", "qnpipe.cli.trace_cmd")
HEAVY = ("mlx_lm", "transformers", "qnpipe.live.core", "qnpipe.model.stepper", "qnpipe.model.qwen3_next")


def test_replay_and_sweeps_load_no_model_code() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {MODEL_FREE!r}:\n    importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # The check itself sees these modules when they are loaded.
    live = subprocess.run([sys.executable, "-c", code.replace("for m in", "import qnpipe.live.core\nfor m in", 1)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "qnpipe.live.core" in json.loads(live.stdout.strip().splitlines()[-1])
