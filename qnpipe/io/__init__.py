"""Bytes on disk: the expert store, the real SSD reader, the simulated SSD, and safe file writing.

`store`/`store_format`/`store_check` are the expert store's layout; `reader` and `ssd` read
records into aligned buffers (the C extension `qnpipe.io._preadx` when built), `device` puts a
reader behind the read scheduler, `simssd` is the simulated SSD replay and the tests run
against, `device_file`/`measure` the measured device profiles; `files` (the capped whole-file
reads of the leaf `qnpipe.files`, under their old path), `atomic`/`outdir` (files and directories that appear
whole), `figure` (plots as PNG, PDF or SVG, through `atomic`) and `heat_file`. It may import
qnpipe.config, qnpipe.errors, qnpipe.messages and the leaves, never qnpipe.policy, the model,
the actors or the live engine (tests/test_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.io.atomic import atomic_file, atomic_write
    from qnpipe.io.device import ExpertDevice, StoreDevice
    from qnpipe.io.files import check_regular, read_capped
    from qnpipe.io.reader import CacheMode, ExpertReader, ReaderStats, ReadRequest, ReadResult
    from qnpipe.io.simssd import DeviceProfile, SimSSD, SimStats, open_simssd
    from qnpipe.io.ssd import SsdReader
    from qnpipe.io.store import ExpertStore, read_index, write_index

# Loaded on first use, not here: importing any submodule runs this file first, and most users
# (replay, the trace tools) must not pull in MLX (`reader`, `store`).
_LAZY = {
    "ExpertStore": "qnpipe.io.store",
    "read_index": "qnpipe.io.store",
    "write_index": "qnpipe.io.store",
    "ExpertReader": "qnpipe.io.reader",
    "ReadRequest": "qnpipe.io.reader",
    "ReadResult": "qnpipe.io.reader",
    "ReaderStats": "qnpipe.io.reader",
    "CacheMode": "qnpipe.io.reader",
    "SsdReader": "qnpipe.io.ssd",
    "ExpertDevice": "qnpipe.io.device",
    "StoreDevice": "qnpipe.io.device",
    "DeviceProfile": "qnpipe.io.simssd",
    "SimSSD": "qnpipe.io.simssd",
    "SimStats": "qnpipe.io.simssd",
    "open_simssd": "qnpipe.io.simssd",
    "atomic_file": "qnpipe.io.atomic",
    "atomic_write": "qnpipe.io.atomic",
    "read_capped": "qnpipe.io.files",
    "check_regular": "qnpipe.io.files",
}
__all__ = [
    "CacheMode", "DeviceProfile", "ExpertDevice", "ExpertReader", "ExpertStore", "ReadRequest", "ReadResult",
    "ReaderStats", "SimSSD", "SimStats", "SsdReader", "StoreDevice", "atomic_file", "atomic_write",
    "check_regular", "open_simssd", "read_capped", "read_index", "write_index",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
