"""top_k and min_p sampling: the host distribution equals mlx-lm's sampler chain, the engine samples by it."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

import qnpipe
from qnpipe.live.mtp.sampling import probs

PROMPT = [5, 17, 300, 42, 9, 77]


def _mlx_lm_dist(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """The distribution mlx-lm's make_sampler draws from: its own filters, in its order, then softmax(x / T)."""
    x = mx.array(logits, dtype=mx.float32)
    x = x - mx.logsumexp(x, keepdims=True)
    if 0.0 < top_p < 1.0:
        x = apply_top_p(x, top_p)
    if min_p:
        x = apply_min_p(x, min_p)
    if top_k:
        x = apply_top_k(x, top_k)
    return np.array(mx.softmax(x / temperature, axis=-1), dtype=np.float64)


@pytest.mark.parametrize("top_p, top_k, min_p", [(1.0, 5, 0.0), (1.0, 0, 0.05), (0.9, 20, 0.02), (0.5, 1, 0.0),
                                                 (1.0, 0, 0.5), (0.95, 3, 0.3)])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_host_distribution_is_mlx_lms(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        logits = rng.normal(0, 3, size=200).astype(np.float32)  # continuous: no ties at the k-th
        want = _mlx_lm_dist(logits, temperature, top_p, top_k, min_p)
        got = probs(logits, temperature, top_p, top_k, min_p)
        assert np.array_equal(got > 0, want > 0)  # the same tokens kept
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_top_k_of_the_whole_vocabulary_keeps_every_token() -> None:
    logits = np.random.default_rng(0).normal(size=50)
    np.testing.assert_array_equal(probs(logits, 1.0, 1.0, 50), probs(logits, 1.0, 1.0, 0))
    np.testing.assert_array_equal(probs(logits, 1.0, 1.0, 500), probs(logits, 1.0, 1.0, 0))


def test_min_p_keeps_tokens_by_probability_relative_to_the_top() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probs(logits, 1.0, 1.0, 0, 0.2)  # keeps p >= 0.2 * 0.5 = 0.1
    assert np.count_nonzero(p) == 3 and math.isclose(p.sum(), 1.0)
    np.testing.assert_allclose(p[:3], np.array([0.5, 0.3, 0.15]) / 0.95)


@pytest.fixture(scope="module")
def eng(tiny_hf: Path):
    with qnpipe.Engine(tiny_hf) as e:
        yield e


def test_top_k_1_and_min_p_1_sample_the_greedy_tokens(eng: qnpipe.Engine) -> None:
    greedy = eng.generate(PROMPT, max_tokens=10, stop_at_eos=False).tokens
    for top_k, min_p in ((1, 0.0), (0, 1.0)):
        got = eng.generate(PROMPT, max_tokens=10, temperature=2.0, seed=5, stop_at_eos=False, top_k=top_k,
                           min_p=min_p).tokens
        assert got == greedy, (top_k, min_p)


def test_top_k_draws_only_from_the_k_most_likely(eng: qnpipe.Engine) -> None:
    first = np.argsort(eng.next_logits(PROMPT))[::-1]
    seen = {eng.generate(PROMPT, max_tokens=1, temperature=5.0, top_k=3, seed=s, stop_at_eos=False).tokens[0]
            for s in range(24)}
    assert seen <= set(first[:3].tolist()) and len(seen) > 1
    # the same seeds without top_k leave the three (so the filter is what kept them there)
    free = {eng.generate(PROMPT, max_tokens=1, temperature=5.0, seed=s, stop_at_eos=False).tokens[0]
            for s in range(24)}
    assert not free <= set(first[:3].tolist())


@pytest.mark.parametrize("kw, msg", [({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
                                     ({"min_p": -0.1}, "min_p")])
def test_bad_top_k_and_min_p(eng: qnpipe.Engine, kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        eng.generate(PROMPT, **kw)


def test_settings_as_keywords_and_as_a_mapping(tiny_hf: Path) -> None:
    from qnpipe.engine_args import resolve, settings_of

    for given in (settings_of(None, {"memory__mlx_cache_limit_gb": 3}),
                  settings_of({"memory.mlx_cache_limit_gb": 3}, {}),
                  settings_of(None, {"memory": {"mlx_cache_limit_gb": 3}})):
        assert resolve(tiny_hf, None, given).memory.mlx_cache_limit_gb == 3


def test_a_mistyped_keyword_setting_is_told_in_a_keyword_spelling(tiny_hf: Path) -> None:
    from qnpipe.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        qnpipe.Engine(tiny_hf, memory__mlx_cache_limit_g=3)
    msg = str(e.value)
    assert "did you mean memory__mlx_cache_limit_gb?" in msg and "settings={" in msg


def test_summary_is_the_stats_lines(eng: qnpipe.Engine) -> None:
    eng.generate(PROMPT, max_tokens=3, stop_at_eos=False)
    text = eng.summary()
    lines = text.splitlines()
    assert lines[0].startswith("[loaded in ") and "requests" in lines[0] and "generated" in lines[0]
    assert any(line.startswith("[experts: resident") for line in lines)
    assert len(text) < 600


def test_open_engine_under_asyncio_says_trio_only(tiny_hf: Path) -> None:
    import asyncio

    async def use() -> None:
        async with qnpipe.open_engine(tiny_hf):
            pass

    with pytest.raises(RuntimeError, match=r"trio only.*qnpipe\.Engine"):
        asyncio.run(use())
