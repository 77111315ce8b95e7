"""The KV-quantization quality gate: greedy token agreement and logits cosine against the unquantized cache.

The reference is the unquantized model's greedy continuation of each prompt. Every cache
variant is then fed the same prompt and continuation (teacher forcing, one token per step
as in decoding), and its logits at each step are compared with the reference's: agreement
= the share of steps whose argmax is the reference token, cosine = the mean cosine
similarity of the logits vectors. A model with every expert resident; MLX thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from qnpipe.config import KvCfg
from qnpipe.model.kvquant import kv_factory
from qnpipe.model.qwen3_next import Model

CacheMaker = Callable[[], list[Any]]


def cache_maker(model: Model, attn: Callable[[], Any]) -> CacheMaker:
    """The model's cache with `attn()` for every full-attention layer (the DeltaNet state as always)."""
    def make() -> list[Any]:
        saved = model.kv_factory
        model.kv_factory = attn
        try:
            return model.make_cache()
        finally:
            model.kv_factory = saved
    return make


def variants(model: Model, bits: Sequence[tuple[int, int]], group_size: int, seed: int = 0) -> dict[str, CacheMaker]:
    """name -> cache maker: "qnpipe K/V" (rotated) for each (k, v) bits, and "mlx-lm B/B" where k == v."""
    hd = model.args.head_dim
    out: dict[str, CacheMaker] = {}
    for k, v in bits:
        cfg = KvCfg(quantize=True, k_bits=k, v_bits=v, group_size=group_size, rotate=True, rot_seed=seed)
        out[f"qnpipe {k}/{v}"] = cache_maker(model, kv_factory(cfg, hd))
        if k == v:
            out[f"mlx-lm {k}/{v}"] = cache_maker(model, lambda b=k: QuantizedKVCache(group_size=group_size, bits=b))
    return out


def _step(model: Model, cache: list[Any], ids: np.ndarray) -> mx.array:
    """Logits `[B, L, V]` float32 of token ids `[B, L]` appended to `cache`."""
    logits = model(mx.array(ids, dtype=mx.uint32), cache=cache).astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def greedy(model: Model, prompts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The unquantized model's `n` greedy tokens `[B, n]` after `prompts [B, P]` and the logits `[B, n, V]`."""
    cache = cache_maker(model, KVCache)()
    last = np.array(_step(model, cache, prompts)[:, -1])
    toks, rows = [], []
    for _ in range(n):
        rows.append(last)
        toks.append(np.argmax(last, axis=-1))
        last = np.array(_step(model, cache, toks[-1][:, None])[:, -1])
    return np.stack(toks, axis=1), np.stack(rows, axis=1)


def forced_logits(model: Model, make_cache: CacheMaker, prompts: np.ndarray, continuation: np.ndarray,
                  block: int = 1) -> np.ndarray:
    """Logits `[B, n, V]`: position i predicts continuation[:, i] after the prompt and continuation[:, :i].

    The continuation is fed `block` tokens per step (1 = as decoding does; more is faster and
    reads the same quantized cache, the block's own keys included).
    """
    cache = make_cache()
    rows = [np.array(_step(model, cache, prompts)[:, -1:])]
    n = continuation.shape[1]
    for lo in range(0, n - 1, block):
        rows.append(np.array(_step(model, cache, continuation[:, lo:min(lo + block, n - 1)])))
    return np.concatenate(rows, axis=1)


def compare(ref_tokens: np.ndarray, ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(greedy token agreement, mean logits cosine) of `logits [..., V]` against the reference."""
    agree = float(np.mean(np.argmax(logits, axis=-1) == ref_tokens))
    num = np.sum(logits * ref_logits, axis=-1)
    den = np.linalg.norm(logits, axis=-1) * np.linalg.norm(ref_logits, axis=-1)
    return agree, float(np.mean(num / den))


def quality_gate(model: Model, prompts: Sequence[Sequence[int]], n_tokens: int,
                 makers: dict[str, CacheMaker], block: int = 1) -> dict[str, tuple[float, float]]:
    """name -> (agreement, cosine) over `n_tokens` greedy tokens after each prompt (one batch: the
    prompts are cut to the shortest one's length)."""
    p = min(len(x) for x in prompts)
    batch = np.array([list(x[:p]) for x in prompts], dtype=np.uint32)
    toks, ref = greedy(model, batch, n_tokens)
    return {name: compare(toks, ref, forced_logits(model, make, batch, toks, block)) for name, make in makers.items()}
