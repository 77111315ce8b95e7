"""Replay's predictors: what each would have hinted at each MoE layer of a log's steps, computed before the run.

`recorded` replays the live gates' `predict.candidates`; `previous`, `transition` and `oracle` are the
model-free guesses of qnpipe.replay.model_free. The guesses become the `LayerRoute.predictions` the forward
hands the predictor, so every driver sees the same hints.
"""

from __future__ import annotations

import msgspec
import numpy as np

from qnpipe.errors import ConfigError
from qnpipe.replay.log import ReplayLog, load_log
from qnpipe.replay.model_free import TransitionTable, oracle_guess, previous_guess

PREDICTORS = ("none", "previous", "recorded", "transition", "oracle")

# What a LogBackend hands the forward at one layer-step: (target, ids [N, W], scores [N, W]) per target.
Predictions = tuple[tuple[int, np.ndarray, np.ndarray], ...]


class PredictorOpts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A replay predictor's settings: `train_frac` of the log's first steps train (and are not replayed),
    or `train_log` does; `recall` and `seed` are the oracle's."""

    train_frac: float = 0.0
    train_log: str = ""
    recall: float = 1.0
    seed: int = 0


def predictions(log: ReplayLog, predictor: str, opts: PredictorOpts, *, width: int,
                first: int = 0) -> list[list[Predictions]]:
    """What the predictor gets at each MoE layer of each replayed step (`log.steps[first:]`), by `predictor`:

    `recorded`: the log's own `predict.candidates` (the live gates' top-W); `previous`: the next
    layer routes as the previous token did; `transition`: the next layer's top-`width` experts
    by a `TransitionTable` learned from `log.steps[:first]` (or `opts.train_log`); `oracle`: the
    next layer's true experts at `opts.recall` (seeded by `opts.seed`). ConfigError when the log
    has nothing to learn from.
    """
    k, num = log.shape.top_k, log.shape.num_experts
    table: TransitionTable | None = None
    if predictor == "recorded" and not log.candidates:
        raise ConfigError("predictor 'recorded': the log has no predict.candidates records (a live run "
                          "with predict.cross_layer_prefetch=true and a trace records them)")
    if predictor == "transition":
        table = TransitionTable(log.shape.moe_layers, num)
        if opts.train_log:
            train = load_log(opts.train_log)
            if train.shape != log.shape:
                raise ConfigError(f"train_log={opts.train_log}: its model {train.shape} is not the log's {log.shape}")
            table.learn_steps(train.steps, k)
        elif first == 0:
            raise ConfigError("predictor 'transition' learns from the log's first steps or another log: "
                              "give train_frac > 0 (--train-frac) or train_log (--train-log)")
        else:
            table.learn_steps(log.steps[:first], k)
    rng = np.random.default_rng(opts.seed)
    before: dict[int, tuple[int, ...]] = dict(log.steps[first - 1]) if first > 0 else {}
    out: list[list[Predictions]] = []
    for j in range(first, len(log.steps)):
        step = log.steps[j]
        row: list[Predictions] = []
        for i, (layer, experts) in enumerate(step):
            preds: Predictions = ()
            nxt = step[i + 1] if i + 1 < len(step) else None
            if predictor == "recorded":
                preds = tuple((target, np.asarray(e, dtype=np.int64).reshape(-1, w),
                               np.asarray(sc, dtype=np.float64).reshape(-1, w))
                              for target, w, e, sc in log.candidates.get((j, layer), ()))
            elif nxt is not None:
                target, n = nxt[0], len(experts) // k
                guess = None
                if predictor == "previous" and target in before:
                    guess = previous_guess(before[target], n, k)
                elif table is not None and table.next_of.get(layer) == target:
                    guess = table.guess(layer, np.asarray(experts, dtype=np.int64).reshape(-1, k), width)
                elif predictor == "oracle":
                    guess = oracle_guess(np.asarray(nxt[1], dtype=np.int64).reshape(-1, k), num, opts.recall, rng)
                if guess is not None:
                    preds = ((target, *guess),)
            row.append(preds)
        out.append(row)
        before = dict(step)
    return out


__all__ = ["PREDICTORS", "PredictorOpts", "Predictions", "predictions"]
