"""Qwen3-Next both ways: qnpipe's native model streamed, mlx-lm's through the generic tier streamed
(`model.tier=generic`), and mlx-lm itself give the same logits bit for bit and the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

import qnpipe
from qnpipe.convert import convert
from qnpipe.convert.tiny import make_tiny
from qnpipe.errors import ConfigError

N_NEW = 6


@pytest.mark.parametrize("bits", [None, 4])
def test_native_and_generic_streamed_equal_mlx_lm(tmp_path: Path, bits: int | None) -> None:
    src = make_tiny(tmp_path / "mlx", layout="mlx", bits=bits, seed=3)
    out = tmp_path / "q"
    convert(src, out)
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 20)]
    ref = mlx_lm_load(str(src))[0]
    want = np.array(ref(mx.array(toks)[None])[0].astype(mx.float32))
    want_greedy = [int(t) for t, _ in generate_step(mx.array(toks), ref, max_tokens=N_NEW)]
    k = int(json.loads((src / "config.json").read_text())["num_experts_per_tok"])
    got = {}
    for tier in ("native", "generic"):
        with qnpipe.Engine(out, expert_slots=k + 1, prefill_chunk_tokens=0,
                           **{"model.tier": tier, "diag.route_verify": True}) as eng:
            logits = eng.logits(toks)
            greedy = list(eng.generate(toks, max_tokens=N_NEW, stop_at_eos=False).tokens)
            stats = eng.stats()
        assert stats.expert_source == "pool" and stats.pool is not None and stats.pool.misses > 0
        got[tier] = (logits, greedy)
    for tier, (logits, greedy) in got.items():
        assert np.array_equal(logits, want), tier
        assert greedy == want_greedy, tier


def test_native_only_settings_on_the_generic_tier_are_named(tmp_path: Path) -> None:
    src = make_tiny(tmp_path / "mlx", layout="mlx", seed=3)
    with pytest.raises(ConfigError, match=r"qwen3_next model on the generic tier \(model.tier=generic\): mtp.enabled"):
        qnpipe.Engine(src, **{"model.tier": "generic", "mtp.enabled": True})
