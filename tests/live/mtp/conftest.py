"""Fixtures of the speculation tests: the trained tiny model (its MTP head drafts well; `trained_hf`,
`trained_qn4` are in tests/conftest.py) as float32 qnpipe directory and loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def trained_qn32(tmp_path_factory: pytest.TempPathFactory, trained_hf: Path) -> Path:
    """`trained_hf` as a qnpipe directory, float32 with a float MTP head: its experts can stream."""
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("models") / "trained-qn32"
    convert(trained_hf, out, dtype="float32", mtp_bits=0)
    return out


@pytest.fixture(scope="module")
def trained_mtp(trained_hf: Path) -> tuple[Any, Any, Any]:
    """(the loaded model, its MTP head, the MLX thread) of `trained_hf`, loaded on the MLX thread."""
    from qnpipe.live.mlx_thread import MLXThread
    from qnpipe.model.load import load_model
    from qnpipe.model.mtp import load_mtp

    th = MLXThread.shared()
    lm = th.submit(load_model, trained_hf).result()
    head = th.submit(load_mtp, lm.args, lm.mtp_weights, str(trained_hf)).result()
    assert head is not None
    return lm, head, th
