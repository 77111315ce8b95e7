"""Runner: the loaded model and tokenizer, used only from the one MLX thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from qnpipe.model.decode import decode, forward_logits, prefill
from qnpipe.model.load import LoadedModel, load_model
from qnpipe.stats import FinishReason, GenerateResult, GenerateStats

TextCallback = Callable[[str], None]


class Runner:
    """Owns the MLX model of one engine; every method must run on the engine's MLX thread."""

    def __init__(self, model_dir: str | Path, *, prefill_chunk: int, tokenizer: bool = True,
                 expert_dir: str | Path | None = None):
        self.loaded: LoadedModel = load_model(model_dir, expert_dir=expert_dir)
        self.prefill_chunk = prefill_chunk
        self.tokenizer: Any = None
        if tokenizer:
            from qnpipe.chat.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(model_dir)

    @property
    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        eos = self.loaded.args.eos_token_id
        if eos is not None:
            ids |= {eos} if isinstance(eos, int) else set(eos)
        return ids

    def encode(self, text: str) -> list[int]:
        from qnpipe.chat.tokenizer import encode

        if self.tokenizer is None:
            raise ValueError("this engine was opened without a tokenizer; pass token ids")
        return encode(self.tokenizer, text)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        self._check_tokens(tokens)
        out = forward_logits(self.loaded.model, tokens, self.prefill_chunk)
        return np.array(out.astype(mx.float32))

    def generate(self, tokens: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                 on_text: TextCallback | None = None,
                 on_prefill: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Sample up to `max_tokens` tokens after `tokens`; stops early at an EOS token.

        `on_prefill(done, total)` is called after each prefill chunk (prompt tokens processed).
        """
        self._check_tokens(tokens)
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=temperature, top_p=top_p if 0.0 < top_p < 1.0 else 0.0)
        model = self.loaded.model
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        cache = model.make_cache()
        first = prefill(model, cache, tokens, self.prefill_chunk, on_prefill)
        detok = self.tokenizer.detokenizer if self.tokenizer is not None else None
        if detok is not None:
            detok.reset()
        eos = self.eos_ids if stop_at_eos else set()
        out: list[int] = []
        reason = FinishReason.LENGTH
        t_first = t0
        for tok in decode(model, cache, first, sampler, max_tokens):
            if not out:
                t_first = time.perf_counter()
            if tok in eos:
                reason = FinishReason.EOS
                break
            out.append(tok)
            if detok is not None:
                detok.add_token(tok)
                if on_text is not None and (seg := detok.last_segment):  # reading it consumes it
                    on_text(seg)
        t_end = time.perf_counter()
        text = ""
        if detok is not None:
            detok.finalize()
            if on_text is not None and (seg := detok.last_segment):
                on_text(seg)
            text = detok.text
        prefill_s = (t_first if out or reason is FinishReason.EOS else t_end) - t0
        decode_s = t_end - t_first if out else 0.0
        n_gen = len(out) + (1 if reason is FinishReason.EOS else 0)
        stats = GenerateStats(
            prompt_tokens=len(tokens),
            generated_tokens=n_gen,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prefill_tok_s=len(tokens) / prefill_s if prefill_s > 0 else 0.0,
            decode_tok_s=(n_gen - 1) / decode_s if decode_s > 0 and n_gen > 1 else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=reason,
        )
        return GenerateResult(tokens=tuple(out), text=text, stats=stats)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 0:
            raise ValueError("empty prompt: pass at least one token")
        V = self.loaded.args.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range for vocabulary size {V}")
