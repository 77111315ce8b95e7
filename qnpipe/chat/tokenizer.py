"""Load a model directory's tokenizer and chat template (through mlx-lm's TokenizerWrapper)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qnpipe.errors import TokenizerError

# Files that hold a vocabulary (tokenizer_config.json only configures one of these).
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def check_tokenizer_files(model_dir: str | Path) -> list[str]:
    """The vocabulary files of `model_dir` (cheap: no tokenizer library is imported).

    Raises TokenizerError naming the missing file when there is no tokenizer, or only a
    tokenizer_config.json (which configures a vocabulary but holds none).
    """
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise TokenizerError(f"{model_dir}: no tokenizer.json or tokenizer_config.json")
    vocab_files = [f for f in _VOCAB_FILES if (model_dir / f).is_file()]
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
    if gen.is_file():
        try:
            e = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TokenizerError(f"{gen}: not valid JSON ({err})") from None
        eos = [e] if isinstance(e, int) else list(e or [])
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
