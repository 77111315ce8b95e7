"""Conversion: a Hugging Face checkpoint to a qnpipe model directory and expert store, and back-checks.

`build.convert` streams the checkpoint through a `plan.ConvertPlan` (what each tensor becomes)
and writes the store's layer files and the non-expert shards (`safetensors_out`); `verify`
re-reads a store and checks every record; `tiny` makes the small random model the tests use.
Offline tooling: it may import the model's checkpoint code and `qnpipe.io`, never trio or the
live engine (tests/test_imports.py).
"""

from __future__ import annotations

from qnpipe.convert.build import (
    CHUNK_BYTES,
    MAX_SHARD_BYTES,
    MODEL_FORMAT,
    MODEL_VERSION,
    ROW_BLOCK_BYTES,
    ConvertReport,
    convert,
)
from qnpipe.convert.tiny import make_tiny
from qnpipe.convert.verify import VerifyReport, verify_store

__all__ = ["CHUNK_BYTES", "MAX_SHARD_BYTES", "ROW_BLOCK_BYTES", "MODEL_FORMAT", "MODEL_VERSION", "ConvertReport",
           "convert", "make_tiny", "VerifyReport", "verify_store"]
