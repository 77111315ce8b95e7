"""Names of the built-in model, usable wherever a model directory is taken (`qnpipe generate tiny`,
`qnpipe.Engine("tiny")`).

A path that exists always wins: `qnpipe make-tiny ./tiny` followed by `qnpipe generate tiny` runs
the directory just written, not the built-in model.
"""

from __future__ import annotations

from pathlib import Path

# A tiny Qwen3-Next trained on the Python standard library, shipped in the package
# (tools/train_tiny.py; its MODEL_CARD.md has the figures; docs/tiny-model.md).
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "data" / "tiny_trained"

# The names users type for it.
BUILTIN_MODELS: dict[str, Path] = {"tiny": DEMO_MODEL_DIR, "demo": DEMO_MODEL_DIR}


def resolve_model_dir(given: str) -> str:
    """`given`, or the built-in model's directory when `given` is one of its names and no such path exists."""
    if given in BUILTIN_MODELS and not Path(given).exists():
        return str(BUILTIN_MODELS[given])
    return given
