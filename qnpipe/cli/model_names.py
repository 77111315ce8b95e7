"""Names of the built-in model, usable wherever a command takes MODEL_DIR (`qnpipe generate tiny -p ...`).

A path that exists always wins: `qnpipe make-tiny ./tiny` followed by `qnpipe generate tiny` runs
the directory just written, not the built-in model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qnpipe.cli.common import DEMO_MODEL_DIR

# The trained tiny model shipped in the package (docs/tiny-model.md), under the names users type.
BUILTIN_MODELS: dict[str, Path] = {"tiny": DEMO_MODEL_DIR, "demo": DEMO_MODEL_DIR}


def resolve_model_dir(given: str) -> str:
    """`given`, or the built-in model's directory when `given` is one of its names and no such path exists."""
    if given in BUILTIN_MODELS and not Path(given).exists():
        return str(BUILTIN_MODELS[given])
    return given


def resolve_builtin_model(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with a built-in model name in MODEL_DIR (or demo's --model) replaced by its directory."""
    for attr in ("model_dir", "model"):
        value = getattr(args, attr, None)
        if isinstance(value, str):
            setattr(args, attr, resolve_model_dir(value))
    return args
