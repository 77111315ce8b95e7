"""A script of tools/ loaded as a module, for the tests of its pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(script: str, name: str | None = None) -> ModuleType:
    """tools/`script` imported under `name` (its stem by default), registered in sys.modules (dataclasses and
    pickling look a module up there)."""
    name = name or Path(script).stem
    spec = importlib.util.spec_from_file_location(name, TOOLS / script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
