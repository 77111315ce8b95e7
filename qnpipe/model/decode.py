"""Prompt chunks, and a plain chunked forward: the reference the pipeline's logits are checked against.

The engine's own prefill and decode loops are step loops over the forward actor (qnpipe.live.decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from qnpipe.model.qwen3_next import Model


def chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """`[lo, hi)` spans of `chunk` tokens covering `n` (0 = one span)."""
    step = n if chunk <= 0 else chunk
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def forward_logits(model: Model, tokens: Sequence[int], chunk: int) -> mx.array:
    """Logits `[L, V]` of a fresh sequence, prefilled `chunk` tokens at a time (0 = all at once)."""
    cache = model.make_cache()
    ids = mx.array(list(tokens), dtype=mx.uint32)[None]
    out = []
    for lo, hi in chunks(ids.shape[1], chunk):
        logits = model(ids[:, lo:hi], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        out.append(logits[0])
    return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]
