"""qnpipe: run mixture-of-experts language models that do not fit in memory.

Importing qnpipe has no side effects; `Engine` and `open_engine` load MLX lazily, after
putting the BLAS of `compute.cpu_blas` in front of MLX's (qnpipe.compute.blas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The configuration is light (msgspec only) and every entry point needs it, so it is
# always there: `import qnpipe; qnpipe.config.load()`.
from qnpipe import config
from qnpipe._version import __version__
from qnpipe.config import Config

__all__ = ["Config", "Engine", "config", "open_engine", "__version__"]

if TYPE_CHECKING:
    from qnpipe.engine import Engine, open_engine


def __getattr__(name: str) -> Any:
    if name in ("Engine", "open_engine"):
        # The engine imports MLX: its CPU BLAS (compute.cpu_blas, from the environment or config
        # file) must be in place first. A config passed to the engine later cannot change it.
        from qnpipe.compute import blas

        if not blas.applied():
            blas.apply(config.load().compute)
        from qnpipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'qnpipe' has no attribute {name!r}")
