"""Speculative sampling's acceptance rule keeps plain sampling's distribution (chi-square, fixed seeds)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from qnpipe.spec.sampling import accept_sampled, draw, probs

V = 8
CHI2_999_DF7 = 24.322  # the 0.999 quantile of chi-square with V - 1 = 7 degrees of freedom
N = 30000


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    n = counts.sum()
    return float(((counts - n * p) ** 2 / (n * p)).sum())


def _dists(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(V), size=3), rng.dirichlet(np.ones(V) * 0.7, size=2)  # p [3, V], q [2, V]


Rule = Callable[[list[int], np.ndarray, np.ndarray, np.random.Generator], tuple[int, int]]


def _emitted(rule: Rule, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts of the first emitted token, and of the second one when the first draft was kept."""
    p, q = _dists(seed)
    rng = np.random.default_rng(seed + 100)
    first, second = np.zeros(V), np.zeros(V)
    for _ in range(N):
        drafts = [draw(q[0], rng), draw(q[1], rng)]
        a, tok = rule(drafts, q, p, rng)
        emitted = [*drafts[:a], tok]
        first[emitted[0]] += 1
        if a >= 1:
            second[emitted[1]] += 1
    return first, second, p


def _always_accept(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    return len(drafts), draw(p[len(drafts)], rng)


def _resample_from_p(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] >= p[i, d]:
            return i, draw(p[i], rng)  # wrong: p, not the residual max(p - q, 0)
    return len(drafts), draw(p[len(drafts)], rng)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_emitted_position_is_distributed_as_p(seed: int) -> None:
    first, second, p = _emitted(accept_sampled, seed)
    assert _chi2(first, p[0]) < CHI2_999_DF7
    assert _chi2(second, p[1]) < CHI2_999_DF7
    assert second.sum() > N / 4  # drafts were kept often enough for the second test to mean something


@pytest.mark.parametrize("rule", [_always_accept, _resample_from_p])
def test_a_wrong_acceptance_rule_fails_the_same_test(rule: Rule) -> None:
    first, _, p = _emitted(rule, 0)
    assert _chi2(first, p[0]) > 10 * CHI2_999_DF7


def test_probs_matches_mlx_lm_sampler_filtering() -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    logits = np.random.default_rng(3).normal(size=(32,)).astype(np.float32) * 3
    lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    kept = np.isfinite(np.array(apply_top_p(mx.array(lp), 0.8)))
    got = probs(logits, 0.7, 0.8)
    assert ((got > 0) == kept).all() and 0 < kept.sum() < 32
    want = np.where(kept, np.exp(logits / 0.7 - (logits / 0.7).max()), 0)
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-6)
