"""The ends of a step (its `Tail`: final hidden states -> the step's value), MLX thread only.

On the generic tier (qnpipe.model.family.load.FamilyModel) the step's value is mlx-lm's logits, not
hidden states: that model's `head` is the identity, so the same tails serve both tiers, and `Logits`
/ `Sampling` read the last row as mlx-lm's `generate_step` does (bit for bit). Its `Settle` evaluates
logits nobody reads; a prefill chunk pays one LM head for them.

They are classes, not closures, so that pipeline parallel (qnpipe.live.parallel) can say which one
a step ends with and run it on the rank that holds the LM head (`TailKind`).
"""

from __future__ import annotations

import enum
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from qnpipe.model.qwen3_next import Model


class TailKind(enum.IntEnum):
    SETTLE = 0
    LOGITS = 1
    LAST_LOGITS = 2
    SAMPLE = 3
    # MTP speculation over the ring (qnpipe.live.parallel.speculate): the last rank runs the MTP head.
    MTP_SETTLE = 4  # a prefill chunk but the last: settle, and the MTP over its rows
    MTP_FIRST = 5  # the last prefill chunk: the first token and the first round's drafts
    MTP_VERIFY = 6  # a verify step of K + 1 rows: the committed tokens and the next drafts


class Settle:
    """Evaluate the step and the cache (a prefill chunk that is not the last): bounds the graph."""

    kind = TailKind.SETTLE

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache

    def __call__(self, h: mx.array) -> None:
        mx.eval(h, [c.state for c in self.cache if c is not None])


class Logits:
    """Logits float32 of every row `(L, V)`, or of the last row only `(V,)`."""

    def __init__(self, model: Model, last_only: bool) -> None:
        self.model = model
        self.last_only = last_only
        self.kind = TailKind.LAST_LOGITS if last_only else TailKind.LOGITS

    def __call__(self, h: mx.array) -> np.ndarray:
        return np.array(self.model.head(h[:, -1, :] if self.last_only else h)[0].astype(mx.float32))


class Sampling:
    """The sampler of one generation (seeded here, as it starts) and its settle tail."""

    def __init__(self, model: Model, cache: list[Any], temperature: float, top_p: float, seed: int | None,
                 top_k: int = 0, min_p: float = 0.0):
        if seed is not None:
            mx.random.seed(seed)
        self.model = model
        self.cache = cache
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.top_k, self.min_p = top_k, min_p
        self.sampler: Any = None  # made at the first token, which tells the vocabulary size top_k is checked against
        self.sample = Sample(self)
        self.settle = Settle(cache)

    def next_token(self, h: mx.array) -> mx.array:
        """The next token from the last position of `h`, queued, not waited for."""
        logits = self.model.head(h[:, -1, :])[0]
        if self.sampler is None:
            self.sampler = sampler(self.temperature, self.top_p, self.top_k, self.min_p, logits.shape[-1])
        y = self.sampler(logits - mx.logsumexp(logits, keepdims=True))
        mx.async_eval(y)
        return y


def sampler(temperature: float, top_p: float, top_k: int, min_p: float, vocab: int) -> Any:
    """mlx-lm's `make_sampler` (top-p, then min-p, then top-k, then temperature); a top_k of the whole
    vocabulary or more keeps every token, as no top_k does (mlx-lm's own refuses it)."""
    return make_sampler(temp=temperature, top_p=top_p if 0.0 < top_p < 1.0 else 0.0, min_p=min_p,
                        top_k=top_k if top_k < vocab else 0)


class Sample:
    """The tail of a step whose last row's token is sampled: `Sampling.next_token`."""

    kind = TailKind.SAMPLE

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def __call__(self, h: mx.array) -> mx.array:
        return self.sampling.next_token(h)
