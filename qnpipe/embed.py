"""The engine's old module name: `qnpipe.embed` read as token embeddings, so it is `qnpipe.engine` now."""

from qnpipe.engine import Engine, open_engine

__all__ = ["Engine", "open_engine"]
