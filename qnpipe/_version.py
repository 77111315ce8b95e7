"""qnpipe's version: a leaf, so a module of any layer (the ring's start-up check, the CLI) reads it without
importing the package root."""

from __future__ import annotations

__version__ = "0.1.0"
