"""The live engine: the only package that imports both trio and MLX.

`loaded` builds a model, its expert slots and the actors' pipeline around the process's one MLX
thread (`mlx_thread`); `decoding` runs generation over it, `prefix` reuses the state of a prompt
prefix seen before, `mtp` drafts with the MTP head and verifies with the main model. It may
import every other package of qnpipe; nothing below it imports it (the API, `qnpipe.engine`, and
the server and CLI above it do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.live.decoding import Output, generate, generate_stats, logits, next_logits
    from qnpipe.live.loaded import LoadedModel, ThreadedBackend, load_model, open_model_pipeline
    from qnpipe.live.mlx_thread import MLXThread, run_on
    from qnpipe.live.prefix import PrefixCache, SnapshotFileWarning, resume
    from qnpipe.live.streaming import Streaming

# Loaded on first use, not here: importing a module here would otherwise start MLX and load mlx-lm
# for a caller that only wants `MLXThread`.
_LAZY = {
    "LoadedModel": "qnpipe.live.loaded",
    "Streaming": "qnpipe.live.streaming",
    "ThreadedBackend": "qnpipe.live.loaded",
    "load_model": "qnpipe.live.loaded",
    "open_model_pipeline": "qnpipe.live.loaded",
    "Output": "qnpipe.live.decoding",
    "generate": "qnpipe.live.decoding",
    "generate_stats": "qnpipe.live.decoding",
    "logits": "qnpipe.live.decoding",
    "next_logits": "qnpipe.live.decoding",
    "MLXThread": "qnpipe.live.mlx_thread",
    "run_on": "qnpipe.live.mlx_thread",
    "PrefixCache": "qnpipe.live.prefix",
    "SnapshotFileWarning": "qnpipe.live.prefix",
    "resume": "qnpipe.live.prefix",
}
__all__ = [
    "LoadedModel", "MLXThread", "Output", "PrefixCache", "SnapshotFileWarning", "Streaming", "ThreadedBackend",
    "generate", "generate_stats", "load_model", "logits", "next_logits", "open_model_pipeline", "resume",
    "run_on",
]


# The names before `Core` (read beside the pool's and read scheduler's cores) became `LoadedModel`.
_OLD = {"Core": "LoadedModel", "build_core": "load_model", "open_core_pipeline": "open_model_pipeline"}


def __getattr__(name: str) -> Any:
    name = _OLD.get(name, name)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
