"""The FLAME captures of tests/data/traces, unpacked once per session."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from real_traces import FLAME_TAR


@pytest.fixture(scope="session")
def flame_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`Encoder_Batch_0-32/` and `Decoder_Batch_0-64/{1st..10th}/`, each with `Layer_{2..9}/*.pt`."""
    root = tmp_path_factory.mktemp("flame")
    with tarfile.open(FLAME_TAR) as t:
        t.extractall(root, filter="data")
    return root / "Sample_routing_traces"
