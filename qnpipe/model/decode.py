"""Prefill (chunked or whole) and the token-by-token decode loop, on the calling (MLX) thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from qnpipe.model.qwen3_next import Model

Sampler = Callable[[mx.array], mx.array]


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    step = n if chunk <= 0 else chunk
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def forward_logits(model: Model, tokens: Sequence[int], chunk: int) -> mx.array:
    """Logits `[L, V]` of a fresh sequence, prefilled `chunk` tokens at a time (0 = all at once)."""
    cache = model.make_cache()
    ids = mx.array(list(tokens), dtype=mx.uint32)[None]
    out = []
    for lo, hi in _chunks(ids.shape[1], chunk):
        logits = model(ids[:, lo:hi], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        out.append(logits[0])
    return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]


def prefill(model: Model, cache: list[Any], tokens: Sequence[int], chunk: int,
            progress: Callable[[int, int], None] | None = None) -> mx.array:
    """Run the prompt through `cache`; returns the logits `[V]` of its last position.

    Peak activation memory follows the chunk, not the prompt.
    """
    ids = mx.array(list(tokens), dtype=mx.uint32)[None]
    n = ids.shape[1]
    hidden = None
    for lo, hi in _chunks(n, chunk):
        hidden = model.model(ids[:, lo:hi], cache=cache)
        mx.eval(hidden, [c.state for c in cache])
        if progress is not None:
            progress(hi, n)
    assert hidden is not None, "empty prompt"
    return model.head(hidden[:, -1, :])[0]


def decode(model: Model, cache: list[Any], first_logits: mx.array, sampler: Sampler,
           max_tokens: int) -> Iterator[int]:
    """Yield up to `max_tokens` sampled tokens, starting from the prompt's last logits.

    Like mlx-lm, the next step's graph is queued with `async_eval` before the current
    token is handed out, so detokenizing overlaps compute.
    """
    if max_tokens <= 0:
        return

    def sample(logits: mx.array) -> mx.array:
        return sampler(logits - mx.logsumexp(logits, keepdims=True))

    def step(y: mx.array) -> mx.array:
        logits = model(y.reshape(1, 1), cache=cache)[0, -1]
        return sample(logits)

    y = sample(first_logits)
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = step(y) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt)
        tok = int(y.item())  # pyright: ignore[reportArgumentType]
        yield tok
        if nxt is None:
            break
        y = nxt
