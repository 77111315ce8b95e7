"""Qwen3-Next in MLX: the model, experts by slot, checkpoint loading, snapshots. Never imports trio.

`args` reads and checks config.json, `checkpoint`/`load` read the weights (whole or with the
experts left in the store), `qwen3_next`/`experts`/`slots` are the model with its experts in
pool slots, `stepper` is the forward's MLX backend, `mtp` the MTP head, `kvquant` the quantized
KV cache, `snapshots` save and restore a model state, `memory` sets MLX's memory limits. It may
import qnpipe.config, qnpipe.io and qnpipe.errors; the actors and the live engine drive it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.model.args import ModelArgs, args_from_dict, config_model_id, model_id, read_config
    from qnpipe.model.load import LoadedModel, load_model
    from qnpipe.model.memory import MemoryLimitWarning, apply_memory_limits
    from qnpipe.model.runner import Runner
    from qnpipe.model.stepper import MlxBackend

# Loaded on first use, not here: importing any of these starts MLX and mlx-lm (about a second).
_LAZY = {
    "ModelArgs": "qnpipe.model.args",
    "args_from_dict": "qnpipe.model.args",
    "model_id": "qnpipe.model.args",
    "read_config": "qnpipe.model.args",
    "config_model_id": "qnpipe.model.args",
    "LoadedModel": "qnpipe.model.load",
    "load_model": "qnpipe.model.load",
    "Runner": "qnpipe.model.runner",
    "MlxBackend": "qnpipe.model.stepper",
    "MemoryLimitWarning": "qnpipe.model.memory",
    "apply_memory_limits": "qnpipe.model.memory",
}
__all__ = [
    "LoadedModel", "MemoryLimitWarning", "MlxBackend", "ModelArgs", "Runner", "apply_memory_limits",
    "args_from_dict", "config_model_id", "load_model", "model_id", "read_config",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
