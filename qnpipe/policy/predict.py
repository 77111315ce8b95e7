"""Cross-layer prediction: which later layers each MoE layer predicts, and the ranking of candidates.

The forward applies the gate of each target layer to the current layer's MoE input
(qnpipe.steps.PredictPlan) and hands the per-token top-W probabilities to the
predictor actor, which ranks them here into one list of experts per target layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from qnpipe.config import PredictAgg, PredictCfg


def predict_targets(moe_layers: Sequence[int], predict_cfg: PredictCfg) -> dict[int, tuple[int, ...]]:
    """MoE layer -> the MoE layers after it that it predicts.

    `ahead_layers` > 0: that many for every layer; else `ahead_lo_layers` for layers below
    `cutoff_layer` (early layers: recall) and `ahead_hi_layers` from it on (time to read).
    """
    out: dict[int, tuple[int, ...]] = {}
    for i, layer in enumerate(moe_layers):
        a = predict_cfg.ahead_layers or (predict_cfg.ahead_lo_layers if layer < predict_cfg.cutoff_layer
                                         else predict_cfg.ahead_hi_layers)
        out[layer] = tuple(moe_layers[i + 1:i + 1 + a])
    return out


def hint_top(predict_cfg: PredictCfg) -> int:
    """Most experts one hint names: a token's `width_experts`, times `candidate_mult` for a step's tokens."""
    return predict_cfg.width_experts * predict_cfg.candidate_mult


def rank(token_experts: Sequence[int], token_scores: Sequence[float], width: int, *, agg: PredictAgg,
         union_k: int, top: int, min_score: float) -> list[tuple[int, float]]:
    """The step's candidates for one target layer, best first: [(expert, score)], at most `top`.

    `token_experts` / `token_scores` are each token's top-`width` (flattened, token-major).
    Aggregation over the step's tokens: `max` (best probability any token gives), `mean`
    (average over tokens, 0 where a token does not list it) or `union` (each token's top
    `union_k`, scored by max). Candidates under `min_score` are dropped. Ties break by
    expert id, so the ranking is deterministic.
    """
    n = len(token_experts) // width if width else 0
    if n == 1 and agg is not PredictAgg.UNION and len(set(token_experts)) == width:
        # One token, distinct experts: its max and its mean are its own scores (the decode case, one sort).
        ranked = sorted(((e, s) for e, s in zip(token_experts, token_scores, strict=True) if s >= min_score),
                        key=lambda es: (-es[1], es[0]))
        return ranked[:top]
    best: dict[int, float] = {}
    total: dict[int, float] = {}
    for t in range(n):
        row = sorted(zip(token_scores[t * width:(t + 1) * width], token_experts[t * width:(t + 1) * width],
                         strict=True), reverse=True)
        if agg is PredictAgg.UNION:
            row = row[:union_k]
        for s, e in row:
            if s > best.get(e, -1.0):
                best[e] = s
            total[e] = total.get(e, 0.0) + s
    scores = {e: total[e] / n for e in total} if agg is PredictAgg.MEAN else best
    ranked = sorted(((e, s) for e, s in scores.items() if s >= min_score), key=lambda es: (-es[1], es[0]))
    return ranked[:top]

