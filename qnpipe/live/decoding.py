"""Prefill, decode and logits as step loops over the forward actor (trio side).

Each step of the model goes through `Forward.run`; the MLX work of a step's end (the LM
head, sampling) is its tail, run on the MLX thread. The decode loop keeps mlx-lm's
pipelining: a step's tail samples the next token and queues it with `async_eval`, and
its value is read only at the next step's first synchronisation.

What every generate loop shares is elsewhere: the prefill's plan and spans in
`qnpipe.live.prefix.Prefill`, the committed tokens, stop reason, times and figures in
`qnpipe.live.session.DecodeSession` (`Output` and `generate_stats` keep their import path here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import trio

from qnpipe.actors.forward import Forward
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.prefix import PrefixCache, prefill
from qnpipe.live.prefix import resume as resume_prefix
from qnpipe.live.session import DecodeSession, Output, TextCallback, generate_stats
from qnpipe.model.decode import chunks
from qnpipe.model.qwen3_next import Model
from qnpipe.model.tails import Logits, Sampling, Settle, TailKind
from qnpipe.stats import GenerateResult

__all__ = ["Output", "TextCallback", "conclude", "generate", "generate_stats", "logits", "next_logits"]


async def logits(fwd: Forward, thread: MLXThread, model: Model, tokens: Sequence[int], chunk: int) -> np.ndarray:
    """Logits `(L, V)` float32 of a fresh sequence, prefilled `chunk` tokens at a time (0 = all)."""
    cache = await run_on(thread, model.make_cache)
    ids = await run_on(thread, _ids, tokens)
    tail = Logits(model, last_only=False)
    out = [await fwd.run(_span(ids, lo, hi), cache, tail) for lo, hi in chunks(len(tokens), chunk)]
    return np.concatenate(out, axis=0) if len(out) > 1 else out[0]


async def next_logits(fwd: Forward, thread: MLXThread, model: Model, tokens: Sequence[int], chunk: int,
                      prefix: PrefixCache | None = None) -> np.ndarray:
    """Logits `(V,)` float32 of the token after `tokens`, resumed from a prefix snapshot when one fits."""
    cache = await run_on(thread, model.make_cache)
    ids = await run_on(thread, _ids, tokens)
    pf = await prefill(thread, tokens, chunk, prefix)
    await resume_prefix(thread, pf.plan, cache, prefix)
    tail, settle = Logits(model, last_only=True), _settle(fwd, cache, Settle(cache))
    out: Any = None
    for lo, hi, last in pf.spans(split_last=True):
        out = await fwd.run(_span(ids, lo, hi), cache, tail if last else settle)
        await pf.reached(hi, cache)
    return out


class _SettleCache:
    """A resident prefill step before the last (mlx-lm's): only the cache is evaluated, so the last
    layer's MoE of the step's rows, which nothing reads, is never computed. Streamed, the step's
    output is evaluated too (`Settle`): its expert work reads slots the forward releases after it."""

    kind = TailKind.SETTLE

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache

    def __call__(self, h: mx.array) -> None:
        mx.eval([c.state for c in self.cache if c is not None])


def _settle(fwd: Forward, cache: list[Any], streamed: Settle) -> Settle | _SettleCache:
    return _SettleCache(cache) if fwd.to_pool is None else streamed


def _ids(tokens: Sequence[int]) -> mx.array:
    return mx.array(list(tokens), dtype=mx.uint32)[None]


# Inputs are built on the MLX thread: an MLX op made on another thread is bound to that thread's stream.
def _span(ids: mx.array, lo: int, hi: int) -> Callable[[], mx.array]:
    return lambda: ids[:, lo:hi]


def _next_input(y: mx.array) -> Callable[[], mx.array]:
    return lambda: y.reshape(1, 1)


def _item(y: mx.array) -> int:
    return int(y.item())  # pyright: ignore[reportArgumentType]  # a token id: an integer scalar


class _ReadAtSync:
    """`Forward.run`'s `first_sync` that reads and commits the previous step's token `y`; `kept` is
    `DecodeSession.commit`'s answer (None: not called yet)."""

    def __init__(self, session: DecodeSession, y: mx.array) -> None:
        self.session = session
        self.y = y
        self.kept: bool | None = None

    def __call__(self) -> bool:
        self.kept = self.session.commit([_item(self.y)], trio.current_time())
        return self.kept


def _start(model: Model, temperature: float, top_p: float, seed: int | None, top_k: int, min_p: float) -> Sampling:
    mx.reset_peak_memory()
    return Sampling(model, model.make_cache(), temperature, top_p, seed, top_k, min_p)


async def conclude(thread: MLXThread, session: DecodeSession, **extra: Any) -> GenerateResult:
    """End `session` now (its held-back text streamed) and build its result with the MLX peak memory of
    the call (reset when the call's MLX state was made)."""
    session.end(trio.current_time())
    peak = await run_on(thread, mx.get_peak_memory)
    return session.result(peak, **extra)


async def generate(fwd: Forward, thread: MLXThread, model: Model, tokenizer: Any, tokens: Sequence[int], *,
                   max_tokens: int, temperature: float, top_p: float, seed: int | None, eos: set[int],
                   chunk: int, on_text: TextCallback | None = None,
                   on_prefill: Callable[[int, int], None] | None = None,
                   partial: list[int] | None = None, prefix: PrefixCache | None = None,
                   top_k: int = 0, min_p: float = 0.0) -> GenerateResult:
    """Sample up to `max_tokens` tokens after `tokens`; stops at a token in `eos`.

    `partial`, when given, receives each token as it is produced (what a caller still
    has after a cancellation). `prefix` resumes the prompt from a kept state of its head
    and keeps new ones (qnpipe.live.prefix).
    """
    t0 = trio.current_time()
    s = await run_on(thread, _start, model, temperature, top_p, seed, top_k, min_p)
    ids = await run_on(thread, _ids, tokens)
    pf = await prefill(thread, tokens, chunk, prefix, on_prefill)
    await resume_prefix(thread, pf.plan, s.cache, prefix)
    y: mx.array | None = None
    settle = _settle(fwd, s.cache, s.settle)
    for lo, hi, last in pf.spans(split_last=True):
        y = await fwd.run(_span(ids, lo, hi), s.cache, s.sample if last else settle)
        await pf.reached(hi, s.cache)
    assert y is not None
    token: mx.array = y
    session = DecodeSession(Output(tokenizer, eos, on_text, partial), len(tokens), max_tokens, t0, pf.start)
    # All resident, the next step is queued before this token is read (mlx-lm's pipelining).
    # Streamed, every layer synchronises: with the MLX calls in this task's turn the token is read
    # at the next step's first router sync, which waits for it anyway, so the host builds that
    # step's first layer while the device ends this one; a stop there ends the step before its
    # first acquire. Otherwise the token is read first.
    ahead = fwd.to_pool is None
    at_sync = not ahead and fwd.takes_hits
    while session.n < max_tokens:
        more = session.n + 1 < max_tokens
        if at_sync and more:
            read = _ReadAtSync(session, token)
            nxt = await fwd.run(_next_input(token), s.cache, s.sample, first_sync=read)
            if read.kept is None:  # the step synced on no router
                read()
            if not read.kept:
                break
            token = nxt
            continue
        nxt = await fwd.run(_next_input(token), s.cache, s.sample) if ahead and more else None
        tok = await run_on(thread, _item, token)
        if not session.commit([tok], trio.current_time()):
            break
        token = nxt if nxt is not None else await fwd.run(_next_input(token), s.cache, s.sample)
    return await conclude(thread, session)
