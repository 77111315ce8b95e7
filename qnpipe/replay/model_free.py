"""Model-free routing guesses for replay: previous token, a transition table, an oracle (pure: numpy only).

Each guesses, for every token of a layer-step, the experts of the next MoE layer with a
score, as the gate-based predictor does (`ids [N, W]`, `scores [N, W]`): the forward sends
them as `Candidates` and the live predictor actor ranks them into hints
(qnpipe.policy.predict.rank), so replay exercises the same prefetch path as a live run.
Ties always break by expert id: the same routes give the same guesses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Guess = tuple[np.ndarray, np.ndarray]  # ids [N, W] (int64), scores [N, W] (float64)


def previous_guess(before: Sequence[int], tokens: int, top_k: int) -> Guess:
    """The last token of the previous step's experts at the target layer, for each of `tokens` tokens."""
    ids = np.tile(np.asarray(before[-top_k:], dtype=np.int64), (tokens, 1))
    return ids, np.ones(ids.shape, dtype=np.float64)


class TransitionTable:
    """Per MoE layer, how often expert `j` of the next MoE layer followed expert `i` of this one (same token).

    `counts[layer]` is `[E, E]`; `guess` scores each next-layer expert by the summed counts
    from the token's experts, normalised to sum to 1 per token.
    """

    def __init__(self, moe_layers: Sequence[int], num_experts: int) -> None:
        self.moe_layers = tuple(moe_layers)
        self.num_experts = num_experts
        self.next_of = dict(zip(self.moe_layers, self.moe_layers[1:], strict=False))
        self.counts = {layer: np.zeros((num_experts, num_experts), dtype=np.float64) for layer in self.next_of}

    def learn(self, layer: int, ids: np.ndarray, next_ids: np.ndarray) -> None:
        """Count the transitions of one layer-step: `ids [N, k]` at `layer`, `next_ids [N, k]` at the next MoE layer."""
        src = np.repeat(ids, next_ids.shape[1], axis=1).reshape(-1)
        dst = np.tile(next_ids, (1, ids.shape[1])).reshape(-1)
        np.add.at(self.counts[layer], (src, dst), 1.0)

    def learn_steps(self, steps: Sequence[Sequence[tuple[int, tuple[int, ...]]]], top_k: int) -> None:
        """Learn every consecutive MoE layer pair of `steps` (each ((layer, experts [N*k]), ...) in layer order)."""
        for step in steps:
            routes = dict(step)
            for layer, nxt in self.next_of.items():
                if layer in routes and nxt in routes and len(routes[layer]) == len(routes[nxt]):
                    self.learn(layer, np.asarray(routes[layer], dtype=np.int64).reshape(-1, top_k),
                               np.asarray(routes[nxt], dtype=np.int64).reshape(-1, top_k))

    def guess(self, layer: int, ids: np.ndarray, width: int) -> Guess | None:
        """Top-`width` next-layer experts of each token of `ids [N, k]` at `layer`; None at the last
        MoE layer or when no transition from these experts was ever seen. Width shrinks to the
        widest row of experts with a non-zero score (never a guess of something unseen)."""
        table = self.counts.get(layer)
        if table is None:
            return None
        scores = table[ids].sum(axis=1)  # [N, E]
        totals = scores.sum(axis=1, keepdims=True)
        if not totals.any():
            return None
        scores = scores / np.where(totals > 0, totals, 1.0)
        return top_by_score(scores, width)


def top_by_score(scores: np.ndarray, width: int) -> Guess:
    """Each row's `width` best columns of `scores [N, E]`, best first (ties: lower id), trimmed to the
    widest row's count of non-zero scores (at least one)."""
    n, e = scores.shape
    w = min(width, e)
    # lexsort: last key is primary -> by -score, then by expert id
    order = np.lexsort((np.broadcast_to(np.arange(e), (n, e)), -scores), axis=1)[:, :w]
    top = np.take_along_axis(scores, order, axis=1)
    keep = max(1, int((top > 0).sum(axis=1).max()))
    return order[:, :keep].astype(np.int64), top[:, :keep].astype(np.float64)


def oracle_guess(true_ids: np.ndarray, num_experts: int, recall: float, rng: np.random.Generator) -> Guess:
    """The true experts `true_ids [N, k]`, each kept with probability `recall` (else replaced by an
    expert that token did not route to), all scored 1: recall `recall` (in expectation), same width."""
    n, k = true_ids.shape
    keep = rng.random((n, k)) < recall
    out = true_ids.copy()
    for t in range(n):
        drop = np.flatnonzero(~keep[t])
        if not len(drop):
            continue
        others = np.setdiff1d(np.arange(num_experts), true_ids[t])
        drop = drop[:len(others)]  # as many wrong guesses as there are experts it did not route to
        out[t, drop] = rng.choice(others, size=len(drop), replace=False)
    return out.astype(np.int64), np.ones((n, k), dtype=np.float64)


__all__ = ["Guess", "TransitionTable", "oracle_guess", "previous_guess", "top_by_score"]
