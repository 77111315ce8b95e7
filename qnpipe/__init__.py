"""qnpipe: run mixture-of-experts language models that do not fit in memory.

Importing qnpipe has no side effects; `Engine` and `open_engine` load MLX lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Config", "Engine", "open_engine", "__version__"]

if TYPE_CHECKING:
    from qnpipe.config import Config
    from qnpipe.embed import Engine, open_engine


def __getattr__(name: str) -> Any:
    if name in ("Engine", "open_engine"):
        from qnpipe import embed

        return getattr(embed, name)
    if name == "Config":
        from qnpipe.config import Config

        return Config
    raise AttributeError(f"module 'qnpipe' has no attribute {name!r}")
