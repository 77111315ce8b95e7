"""Load a model directory's tokenizer and chat template (through mlx-lm's TokenizerWrapper)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qnpipe.errors import TokenizerError
from qnpipe.io.files import CONFIG_CAP, SMALL_CAP, check_regular, read_capped

# Files that hold a vocabulary (tokenizer_config.json only configures one of these).
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")
# Every file the tokenizer libraries may read whole from a model directory: each present one must be
# a regular file of at most TOKENIZER_CAP bytes before any of them is opened (a FIFO would block the
# library's read for good, /dev/zero would fill memory).
_READ_FILES = (*_VOCAB_FILES, "tokenizer_config.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "chat_template.json", "generation_config.json")
TOKENIZER_CAP = SMALL_CAP  # the largest real tokenizer.json files are ~35 MB


def check_tokenizer_files(model_dir: str | Path) -> list[str]:
    """The vocabulary files of `model_dir` (cheap: no tokenizer library is imported).

    Raises TokenizerError naming the file when there is no tokenizer, only a
    tokenizer_config.json (which configures a vocabulary but holds none), or a tokenizer or
    chat-template file that is not a regular file or is too large.
    """
    model_dir = Path(model_dir)
    present = [f for f in _READ_FILES if os.path.lexists(model_dir / f)]
    for f in present:
        check_regular(model_dir / f, cap=TOKENIZER_CAP, error=TokenizerError)
    if "tokenizer.json" not in present and "tokenizer_config.json" not in present:
        raise TokenizerError(f"{model_dir}: no tokenizer.json or tokenizer_config.json")
    vocab_files = [f for f in _VOCAB_FILES if f in present]
    if not vocab_files:
        raise TokenizerError(f"{model_dir / 'tokenizer.json'}: missing; tokenizer_config.json alone has no "
                             f"vocabulary (copy tokenizer.json from the original checkpoint)")
    return vocab_files


def load_tokenizer(model_dir: str | Path) -> Any:
    """mlx-lm `TokenizerWrapper` for `model_dir`: HF tokenizer + streaming detokenizer + eos ids.

    Raises TokenizerError naming the directory when it has no tokenizer or it cannot be parsed.
    """
    from mlx_lm.tokenizer_utils import load

    model_dir = Path(model_dir)
    vocab_files = check_tokenizer_files(model_dir)
    eos: list[int] = []
    gen = model_dir / "generation_config.json"
    if os.path.lexists(gen):
        try:
            raw = json.loads(read_capped(gen, CONFIG_CAP, error=TokenizerError))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise TokenizerError(f"{gen}: not valid JSON ({err})") from None
        e = raw.get("eos_token_id") if isinstance(raw, dict) else None
        ids = [e] if isinstance(e, int) else e if isinstance(e, list) else []
        if not all(type(i) is int for i in ids):
            raise TokenizerError(f"{gen}: eos_token_id is {e!r}; expected a token id or a list of them")
        eos = list(ids)
    try:
        tok = load(model_dir, eos_token_ids=eos or None)
        size = len(tok.get_vocab())
    except Exception as e:  # transformers raises many unrelated types for a broken tokenizer
        raise TokenizerError(f"{model_dir}: cannot load tokenizer ({type(e).__name__}: {e})") from None
    if size == 0:
        raise TokenizerError(f"{model_dir / vocab_files[0]}: the tokenizer has an empty vocabulary")
    return tok


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` under the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("this tokenizer has no chat_template")
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, tokenize=False,
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, special tokens matched, no BOS added (Qwen adds none)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
