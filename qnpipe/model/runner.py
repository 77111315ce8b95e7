"""Runner: the loaded model and tokenizer, used only from the one MLX thread."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qnpipe.model.load import LoadedModel, load_model
from qnpipe.model.stage import Stage


class Runner:
    """Owns the MLX model of one engine; every method must run on the engine's MLX thread.

    `tier` is config `model.tier` (qnpipe.model.load.load_model). `resident_experts` False leaves a qnpipe directory's routed experts on disk (the pool
    streams them). The tokenizer is optional: a directory without one takes token ids only.
    """

    def __init__(self, model_dir: str | Path, *, prefill_chunk: int, tokenizer: bool = True,
                 expert_dir: str | Path | None = None, resident_experts: bool = True, verify: bool = False,
                 topk_override: int | None = None, stage: Stage | None = None, tier: str = "native"):
        self.model_dir = Path(model_dir)
        # A LoadedModel (native Qwen3-Next) or a FamilyLoaded (generic tier: qnpipe.model.family.load).
        self.loaded: LoadedModel = load_model(model_dir, expert_dir=expert_dir, resident_experts=resident_experts,
                                              verify=verify, topk_override=topk_override, stage=stage, tier=tier)
        self.prefill_chunk = prefill_chunk
        self.tokenizer: Any = None
        if tokenizer and _has_tokenizer(self.model_dir):
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
            raise ValueError(f"{self.model_dir} has no tokenizer (tokenizer.json / tokenizer_config.json): "
                             f"pass token ids instead of text")
        return encode(self.tokenizer, text)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 0:
            raise ValueError("empty prompt: pass at least one token")
        V = self.loaded.args.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range for vocabulary size {V}")


def _has_tokenizer(model_dir: Path) -> bool:
    # lexists: a tokenizer file that is a FIFO or a directory is refused by name (load_tokenizer), not ignored.
    return any(os.path.lexists(model_dir / n) for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
