"""Prefill, decode and logits as step loops over the forward actor (trio side).

Each step of the model goes through `Forward.run`; the MLX work of a step's end (the LM
head, sampling) is its tail, run on the MLX thread. The decode loop keeps mlx-lm's
pipelining: a step's tail samples the next token and queues it with `async_eval`, and
its value is read only at the next step's first synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import trio

from qnpipe.actors.forward import Forward
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.prefix import PrefixCache
from qnpipe.live.prefix import resume as resume_prefix
from qnpipe.model.decode import chunks
from qnpipe.model.qwen3_next import Model
from qnpipe.model.tails import Logits, Sampling, Settle
from qnpipe.stats import FinishReason, GenerateResult, GenerateStats

TextCallback = Callable[[str], None]


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
    plan = await prefix.plan(thread, tokens, chunk) if prefix is not None else None
    if plan is not None:
        await resume_prefix(thread, plan, cache, prefix)
    spans = plan.spans if plan is not None else chunks(len(tokens), chunk)
    tail, settle = Logits(model, last_only=True), Settle(cache)
    out: Any = None
    for i, (lo, hi) in enumerate(spans):
        out = await fwd.run(_span(ids, lo, hi), cache, tail if i == len(spans) - 1 else settle)
        if plan is not None and prefix is not None:
            await prefix.reached(thread, plan, hi, cache)
    return out


def _ids(tokens: Sequence[int]) -> mx.array:
    return mx.array(list(tokens), dtype=mx.uint32)[None]


# Inputs are built on the MLX thread: an MLX op made on another thread is bound to that thread's stream.
def _span(ids: mx.array, lo: int, hi: int) -> Callable[[], mx.array]:
    return lambda: ids[:, lo:hi]


def _next_input(y: mx.array) -> Callable[[], mx.array]:
    return lambda: y.reshape(1, 1)


def _item(y: mx.array) -> int:
    return int(y.item())  # pyright: ignore[reportArgumentType]  # a token id: an integer scalar


def _start(model: Model, temperature: float, top_p: float, seed: int | None) -> Sampling:
    mx.reset_peak_memory()
    return Sampling(model, model.make_cache(), temperature, top_p, seed)


class Output:
    """A generate call's committed tokens: kept in `tokens`, streamed as text, stopped by EOS."""

    def __init__(self, tokenizer: Any, eos: set[int], on_text: TextCallback | None, tokens: list[int] | None) -> None:
        self.tokens: list[int] = [] if tokens is None else tokens
        self.eos = eos
        self.on_text = on_text
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()

    def commit(self, tok: int) -> bool:
        """Keep `tok` and stream its text; False (nothing kept) when it ends the sequence."""
        if tok in self.eos:
            return False
        self.tokens.append(tok)
        if self.detok is not None:
            self.detok.add_token(tok)
            if self.on_text is not None and (seg := self.detok.last_segment):  # reading it consumes it
                self.on_text(seg)
        return True

    def finish(self) -> str:
        """The whole text; streams what the detokenizer still held back."""
        if self.detok is None:
            return ""
        self.detok.finalize()
        if self.on_text is not None and (seg := self.detok.last_segment):
            self.on_text(seg)
        return self.detok.text


def generate_stats(prompt_tokens: int, n: int, t0: float, t_first: float, t_end: float, peak: int,
                   reason: FinishReason, **extra: Any) -> GenerateStats:
    """The figures of a generate call from its trio-clock times (prompt in at t0, first token at t_first)."""
    prefill_s = (t_first if n else t_end) - t0
    decode_s = t_end - t_first if n else 0.0
    return GenerateStats(
        prompt_tokens=prompt_tokens, generated_tokens=n, prefill_s=prefill_s, decode_s=decode_s,
        prefill_tok_s=prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=(n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0,
        peak_memory_bytes=int(peak), finish_reason=reason, **extra)


async def generate(fwd: Forward, thread: MLXThread, model: Model, tokenizer: Any, tokens: Sequence[int], *,
                   max_tokens: int, temperature: float, top_p: float, seed: int | None, eos: set[int],
                   chunk: int, on_text: TextCallback | None = None,
                   on_prefill: Callable[[int, int], None] | None = None,
                   partial: list[int] | None = None, prefix: PrefixCache | None = None) -> GenerateResult:
    """Sample up to `max_tokens` tokens after `tokens`; stops at a token in `eos`.

    `partial`, when given, receives each token as it is produced (what a caller still
    has after a cancellation). `prefix` resumes the prompt from a kept state of its head
    and keeps new ones (qnpipe.live.prefix).
    """
    t0 = trio.current_time()
    s = await run_on(thread, _start, model, temperature, top_p, seed)
    ids = await run_on(thread, _ids, tokens)
    plan = await prefix.plan(thread, tokens, chunk) if prefix is not None else None
    if plan is not None:
        await resume_prefix(thread, plan, s.cache, prefix)
    spans = plan.spans if plan is not None else chunks(len(tokens), chunk)
    y: mx.array | None = None
    for i, (lo, hi) in enumerate(spans):
        y = await fwd.run(_span(ids, lo, hi), s.cache, s.sample if i == len(spans) - 1 else s.settle)
        if plan is not None and prefix is not None:
            await prefix.reached(thread, plan, hi, s.cache)
        if on_prefill is not None:
            on_prefill(hi, len(tokens))
    assert y is not None
    token: mx.array = y
    output = Output(tokenizer, eos, on_text, partial)
    reason = FinishReason.LENGTH
    t_first = t0
    n = 0
    # All resident, the next step is queued before this token is read (mlx-lm's pipelining);
    # streamed, every layer synchronises anyway, so the token is read first.
    ahead = fwd.to_pool is None
    while n < max_tokens:
        more = n + 1 < max_tokens
        nxt = await fwd.run(_next_input(token), s.cache, s.sample) if ahead and more else None
        tok = await run_on(thread, _item, token)
        if n == 0:
            t_first = trio.current_time()
        n += 1
        if not output.commit(tok):
            reason = FinishReason.EOS
            break
        if not more:
            break
        token = nxt if nxt is not None else await fwd.run(_next_input(token), s.cache, s.sample)
    t_end = trio.current_time()
    text = output.finish()
    peak = await run_on(thread, mx.get_peak_memory)
    stats = generate_stats(len(tokens), n, t0, t_first, t_end, peak, reason,
                           prefix_tokens_reused=plan.start if plan is not None else 0)
    return GenerateResult(tokens=tuple(output.tokens), text=text, stats=stats)
