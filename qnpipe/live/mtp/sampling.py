"""Speculative sampling: the acceptance rule that keeps the output distribution plain sampling's.

`probs` turns logits into the distribution plain sampling draws from (mlx-lm's sampler: top-p,
min-p and top-k on the temperature-1 probabilities, in that order, then temperature). A draft `d_i` drawn from the
drafter's `q_i` is kept with probability `min(1, p_i(d_i) / q_i(d_i))`; at the first
rejection the token is drawn from `normalise(max(p_i - q_i, 0))`, and when every draft is
kept the next one from `p_{K+1}`. Each emitted token is then distributed as `p` (Leviathan
et al. 2023, Chen et al. 2023). Host-side NumPy with one seeded generator: reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> np.ndarray:
    """The sampling distribution of `logits [..., V]` (float64), as mlx-lm's
    `make_sampler(temperature, top_p, min_p, top_k=top_k)`; a top_k of V or more keeps every token."""
    x = logits.astype(np.float64)
    if 0.0 < top_p < 1.0:
        lp = x - _logsumexp(x)
        srt = np.sort(lp, axis=-1)
        sp = np.exp(srt)
        above = np.cumsum(sp[..., ::-1], axis=-1)[..., ::-1] - sp  # mass strictly above each sorted entry
        total = above[..., :1] + sp[..., :1]
        dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)
        threshold = np.take_along_axis(srt, dropped, axis=-1)
        x = np.where(lp < threshold, -np.inf, x)
    if min_p > 0.0:  # relative to the most likely token: the normalisation cancels
        x = np.where(x < x.max(axis=-1, keepdims=True) + np.log(min_p), -np.inf, x)
    if 0 < top_k < x.shape[-1]:
        at = x.shape[-1] - top_k
        kth = np.partition(x, at, axis=-1)[..., at:at + 1]
        x = np.where(x < kth, -np.inf, x)  # ties at the k-th keep more than k, where mlx-lm's partition picks
    x = x / temperature
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the distribution `p [V]`."""
    return int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right").clip(0, p.shape[-1] - 1))


def judge(d: int, q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> int | None:
    """None when the draft `d` (drawn from `q [V]`) is kept against `p [V]`, else the token drawn instead."""
    if rng.random() * q[d] < p[d]:  # u < p/q, without dividing by a zero q
        return None
    residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:  # p == q up to rounding: any draw from p is exact
        residual = p
    return draw(residual, rng)


def accept_sampled(drafts: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """(kept drafts `a`, the next token) for drafts drawn from `q [K, V]`, verified against `p [K+1, V]`."""
    for i, d in enumerate(drafts):
        if (tok := judge(d, q[i], p[i], rng)) is not None:
            return i, tok
    return len(drafts), draw(p[len(drafts)], rng)
