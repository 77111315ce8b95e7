"""Speculative sampling's acceptance rule keeps plain sampling's distribution (chi-square, fixed seeds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qnpipe.live.mtp.sampling import accept_sampled, draw, probs

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


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_every_emitted_position_is_distributed_as_p(seed: int) -> None:
    first, second, p = _emitted(accept_sampled, seed)
    assert _chi2(first, p[0]) < CHI2_999_DF7
    assert _chi2(second, p[1]) < CHI2_999_DF7
    assert second.sum() > N / 4  # drafts were kept often enough for the second test to mean something


@pytest.mark.slow
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


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random tiny model cut to a 16-token vocabulary (embedding and LM head rows 0..15), no tokenizer."""
    import mlx.core as mx

    from qnpipe.convert.tiny import make_tiny

    d = make_tiny(tmp_path_factory.mktemp("models") / "v16", layout="hf", seed=4)
    for f in d.glob("tokenizer*"):
        f.unlink()
    w = mx.load(str(d / "model.safetensors"))
    assert isinstance(w, dict)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w[name] = w[name][:16]
    mx.save_safetensors(str(d / "model.safetensors"), w)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(vocab_size=16, eos_token_id=None)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.slow
def test_sampled_speculation_matches_plain_sampling_end_to_end(tiny_vocab: Path) -> None:
    """Token 2 of each run (the first one a draft can supply) against its exact plain-sampling distribution."""
    import mlx.core as mx
    import trio

    from qnpipe.actors.forward import Forward
    from qnpipe.live.loaded import ThreadedBackend
    from qnpipe.live.mlx_thread import MLXThread
    from qnpipe.live.mtp import loop
    from qnpipe.model.load import load_model
    from qnpipe.model.mtp import load_mtp
    from qnpipe.model.stepper import MlxBackend

    prompt, T, runs = [3, 7, 1, 12], 3.0, 240  # T = 3: the random head's and the model's distributions overlap
    th = MLXThread.shared()
    lm = th.submit(load_model, tiny_vocab).result()
    head = th.submit(load_mtp, lm.args, lm.mtp_weights, "v16").result()
    assert head is not None

    def exact() -> tuple[np.ndarray, np.ndarray]:
        p1 = probs(np.array(lm.model(mx.array([prompt], dtype=mx.uint32))[0, -1]), T, 1.0)
        rows = lm.model(mx.array([[*prompt, t] for t in range(16)], dtype=mx.uint32))[:, -1]
        return p1 @ probs(np.array(rows), T, 1.0), p1

    want, p1 = th.submit(exact).result()

    async def main() -> tuple[np.ndarray, list[Any]]:
        fwd = Forward(ThreadedBackend(th, MlxBackend(lm.model, None)), None, None, {}, 16)
        counts = np.zeros(16)
        stats = []
        for seed in range(runs):
            opts = loop.SpecOptions(k=1, hidden=loop.MtpHidden.POST_NORM, temperature=T, seed=seed)
            res = await loop.generate(fwd, th, lm.model, head, None, prompt, max_tokens=2, eos=set(), chunk=0,
                                      opts=opts)
            counts[res.tokens[1]] += 1
            stats.append(res.stats.mtp)
        return counts, stats

    counts, stats = trio.run(main)
    accepted = sum(s.accepted_at[0] for s in stats)
    assert 0.1 * runs < accepted < 0.9 * runs  # both branches of the rule were taken, often
    # Cells with an expected count under 5 are pooled (the chi-square approximation needs it).
    big = want * runs >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(want[big], want[~big].sum())
    df = int(big.sum())  # cells - 1
    stat = _chi2(obs[exp > 0], exp[exp > 0])
    assert stat < CHI2_999[df], (stat, df)
    # The same test tells the first token's distribution apart from the second's.
    assert _chi2(obs[exp > 0], np.append(p1[big], p1[~big].sum())[exp > 0]) > CHI2_999[df]


# 0.999 quantiles of chi-square by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25}


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["batch", "sequential"])
def test_seeded_speculative_sampling_repeats(trained_qn4: Path, verify: str) -> None:
    import qnpipe

    over = {"mtp.hidden": "post_norm", "mtp.verify_mode": verify, "pool.expert_slots": 6}
    with qnpipe.Engine(trained_qn4, mtp=True, **over) as eng:
        a = eng.generate("def f(x):", max_tokens=24, temperature=0.8, seed=3, stop_at_eos=False)
        b = eng.generate("def f(x):", max_tokens=24, temperature=0.8, seed=3, stop_at_eos=False)
        c = eng.generate("def f(x):", max_tokens=24, temperature=0.8, seed=4, stop_at_eos=False)
    assert a.tokens == b.tokens != c.tokens
    assert a.stats.mtp is not None and a.stats.mtp.rounds < 24 and sum(a.stats.mtp.accept_hist[1:]) > 0
