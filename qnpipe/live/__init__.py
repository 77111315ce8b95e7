"""The live engine: the only package that imports both trio and MLX.

`core` builds a model, its expert slots and the actors' pipeline around the process's one MLX
thread (`mlx_thread`); `decoding` runs generation over it, `prefix` reuses the state of a prompt
prefix seen before, `spec` drafts with the MTP head and verifies with the main model. It may
import every other package of qnpipe; nothing below it imports it (the API, `qnpipe.engine`, and
the server and CLI above it do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.live.core import Core, Streaming, ThreadedBackend, build_core, open_core_pipeline
    from qnpipe.live.decoding import Output, generate, generate_stats, logits, next_logits
    from qnpipe.live.mlx_thread import MLXThread, run_on
    from qnpipe.live.prefix import PrefixCache, SnapshotFileWarning, resume

# Loaded on first use, not here: importing a module here would otherwise start MLX and load mlx-lm
# for a caller that only wants `MLXThread`.
_LAZY = {
    "Core": "qnpipe.live.core",
    "Streaming": "qnpipe.live.core",
    "ThreadedBackend": "qnpipe.live.core",
    "build_core": "qnpipe.live.core",
    "open_core_pipeline": "qnpipe.live.core",
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
    "Core", "MLXThread", "Output", "PrefixCache", "SnapshotFileWarning", "Streaming", "ThreadedBackend",
    "build_core", "generate", "generate_stats", "logits", "next_logits", "open_core_pipeline", "resume",
    "run_on",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
