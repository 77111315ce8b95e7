"""One generate call's bookkeeping, with no I/O: the tokens it commits, why it stops, its times and figures.

Plain decoding (qnpipe.live.decoding), MTP speculation (qnpipe.live.mtp.loop) and MTP over the
ring (qnpipe.live.parallel.speculate) differ only in what one round makes; each feeds its rounds'
tokens and its clock readings to a `DecodeSession`, which streams the text, says when to stop and
builds the `GenerateResult`. Nothing here awaits, reads a clock or touches MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from qnpipe.stats import FinishReason, GenerateResult, GenerateStats

TextCallback = Callable[[str], None]


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


class DecodeSession:
    """The decode of one prompt as its driver reports it: rounds of tokens in, "go on or stop" out.

    `n` counts every token made, the one that ends the sequence (EOS) too; `output.tokens` holds the
    kept ones. A round's tokens are committed one by one and the first that hits EOS or the length
    limit ends the call, so a round that made more than was wanted commits only what was.
    """

    def __init__(self, output: Output, prompt_tokens: int, max_tokens: int, t0: float,
                 prefix_tokens_reused: int = 0) -> None:
        self.output = output
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.prefix_tokens_reused = prefix_tokens_reused
        self.n = 0
        self.reason: FinishReason | None = None  # None: not stopped yet
        self.t0 = self.t_first = self.t_end = t0
        self.text: str | None = None  # None: not ended yet

    @property
    def kept(self) -> int:
        """Tokens kept so far (the EOS that ends the sequence is not)."""
        return len(self.output.tokens)

    def commit(self, tokens: Sequence[int], now: float) -> bool:
        """Commit a round's tokens (`now`: when they were in hand; the first round's is the first token's
        time); True when generation goes on, False when it ended (`reason`: EOS or LENGTH)."""
        if self.n == 0:
            self.t_first = now
        for tok in tokens:
            self.n += 1
            if not self.output.commit(tok):
                self.reason = FinishReason.EOS
                return False
            if self.n >= self.max_tokens:
                self.reason = FinishReason.LENGTH
                return False
        return True

    def end(self, now: float) -> str:
        """The decode is over at `now` (a driver that stops on its own stops at the length limit);
        streams what the detokenizer held back and returns the whole text."""
        self.t_end = now
        if self.reason is None:
            self.reason = FinishReason.LENGTH
        self.text = self.output.finish()
        return self.text

    def result(self, peak_memory: int, **extra: Any) -> GenerateResult:
        """The call's result after `end`; `extra`: fields of GenerateStats only some drivers have (`mtp`)."""
        assert self.text is not None and self.reason is not None, "DecodeSession.result before end"
        stats = generate_stats(self.prompt_tokens, self.n, self.t0, self.t_first, self.t_end, peak_memory,
                               self.reason, prefix_tokens_reused=self.prefix_tokens_reused, **extra)
        return GenerateResult(tokens=tuple(self.output.tokens), text=self.text, stats=stats)
