"""Prefill + token-by-token decode, chunked or not, equals one full forward."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.model.decode import forward_logits
from qnpipe.model.load import load_model


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 1, 3, 7])
def test_incremental_decode_equals_full_forward(tiny_hf: Path, chunk: int) -> None:
    model = load_model(tiny_hf).model
    toks = [int(t) for t in np.random.default_rng(5).integers(3, 1024, 40)]
    full = np.array(model(mx.array(toks)[None])[0])
    # Prefill the first 25 tokens in chunks, then feed the rest one at a time.
    cache = model.make_cache()
    ids = mx.array(toks)[None]
    rows = []
    step = 25 if chunk == 0 else chunk
    for lo in range(0, 25, step):
        rows.append(model(ids[:, lo:min(lo + step, 25)], cache=cache)[0])
    for t in range(25, 40):
        rows.append(model(ids[:, t:t + 1], cache=cache)[0])
    inc = np.array(mx.concatenate(rows))
    scale = np.abs(full).max()
    assert np.abs(inc - full).max() <= 1e-5 * scale


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
def test_chunked_prefill_logits_equal_unchunked(tiny_hf: Path, chunk: int) -> None:
    model = load_model(tiny_hf).model
    toks = [int(t) for t in np.random.default_rng(6).integers(3, 1024, 33)]
    whole = np.array(forward_logits(model, toks, 0))
    part = np.array(forward_logits(model, toks, chunk))
    assert part.shape == whole.shape == (33, 1024)
    assert np.abs(part - whole).max() <= 1e-5 * np.abs(whole).max()
