"""The real traces of tests/data/traces (gzipped copies; README.md there credits the sources)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
MARIO = DATA / "Mario928__speculative-moe"
WEIRAN = DATA / "weiran0129__vLLM-MoE-Logger"
TOTANI = DATA / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz"


@pytest.fixture(scope="session")
def flame_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FLAME captures, unpacked: `Encoder_Batch_0-32/` and `Decoder_Batch_0-64/{1st..10th}/`."""
    root = tmp_path_factory.mktemp("flame")
    with tarfile.open(DATA / "Akash-N-Pai__DynaNDE-Simulator" / "Sample_routing_traces.tar.gz") as t:
        t.extractall(root, filter="data")
    return root / "Sample_routing_traces"
