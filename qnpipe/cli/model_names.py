"""The built-in model's names on the command line: MODEL_DIR (or demo's --model) `tiny` runs the model
shipped in the package (qnpipe.builtin_models)."""

from __future__ import annotations

import argparse

from qnpipe.builtin_models import BUILTIN_MODELS, resolve_model_dir

__all__ = ["BUILTIN_MODELS", "resolve_builtin_model", "resolve_model_dir"]


def resolve_builtin_model(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with a built-in model name in MODEL_DIR (or demo's --model) replaced by its directory."""
    for attr in ("model_dir", "model"):
        value = getattr(args, attr, None)
        if isinstance(value, str):
            setattr(args, attr, resolve_model_dir(value))
    return args
