"""Checks of caller-supplied values made before any work starts, shared by the CLI and the API.

Every function raises ValueError (a ConfigError for settings) whose message names the argument
and the value; none needs MLX or a loaded model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from qnpipe.errors import ConfigError

__all__ = [
    "check_generate_args", "check_max_tokens", "check_min_p", "check_prompt", "check_seed", "check_temperature",
    "check_text", "check_top_k", "check_top_p", "check_topk_override", "context_warning",
]


def check_max_tokens(max_tokens: Any, name: str = "max_tokens") -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= 0, got {max_tokens!r}")
    if max_tokens < 0:
        raise ValueError(f"{name} must be >= 0, got {max_tokens}")
    return int(max_tokens)


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    return v


def check_temperature(temperature: Any, name: str = "temperature") -> float:
    v = _real(temperature, name)
    if v < 0:
        raise ValueError(f"{name} must be >= 0 (0 = greedy), got {v}")
    return v


def check_top_p(top_p: Any, name: str = "top_p") -> float:
    v = _real(top_p, name)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {v}")
    return v


def check_top_k(top_k: Any, name: str = "top_k") -> int:
    """0 (off) or the number of most likely tokens sampling keeps (mlx-lm's `top_k`)."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0 = off), got {top_k!r}")
    return int(top_k)


def check_min_p(min_p: Any, name: str = "min_p") -> float:
    """0 (off) or the least probability, relative to the top token's, a token needs to be sampled (mlx-lm's)."""
    v = _real(min_p, name)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (0 = off), got {v}")
    return v


def check_seed(seed: Any, name: str = "seed") -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= 0 or None, got {seed!r}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), got {seed}")
    return int(seed)


def check_text(text: str, name: str) -> str:
    """`text` must encode as UTF-8 (argv and stdin may carry undecodable bytes as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {bad!r}"
        raise ValueError(f"{name} is not valid UTF-8 ({byte} at position {e.start})") from None
    return text


def check_prompt(prompt: Any, name: str = "prompt") -> str | list[int]:
    """A text prompt (non-empty, valid UTF-8) or a non-empty sequence of int token ids.

    bytes, floats (even 3.0), bools and other types are refused rather than coerced.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{name} is empty: give some text or at least one token id")
        return check_text(prompt, name)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name} is {type(prompt).__name__}: pass text (str) or a sequence of int token ids")
    if not isinstance(prompt, Sequence) and not hasattr(prompt, "__array__"):
        raise ValueError(f"{name} must be text (str) or a sequence of int token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError(f"{name} is empty: give some text or at least one token id")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{name}[{i}] must be an int token id, got {t!r} ({type(t).__name__})")
        if t < 0:
            raise ValueError(f"{name}[{i}]: token id {t} is negative")
    return [int(t) for t in ids]


def check_generate_args(prompt: Any, *, max_tokens: Any, temperature: Any, top_p: Any,
                        seed: Any, top_k: Any = 0, min_p: Any = 0.0) -> None:
    """Check every argument of `Engine.generate` before any work; ValueError names the first bad one."""
    check_prompt(prompt)
    check_max_tokens(max_tokens)
    check_temperature(temperature)
    check_top_p(top_p)
    check_top_k(top_k)
    check_min_p(min_p)
    check_seed(seed)


def check_topk_override(topk: int | None, num_experts: int, source: str = "forward.moe_topk_override") -> None:
    """`forward.moe_topk_override` must be in 1..num_experts of the model (ConfigError otherwise)."""
    if topk is None:
        return
    if not 1 <= topk <= num_experts:
        raise ConfigError(f"{source}={topk}: must be in 1..{num_experts} (this model has {num_experts} experts)")


def context_warning(n_tokens: int, max_position_embeddings: int) -> str | None:
    """A warning when a prompt of `n_tokens` is longer than the model's context, else None."""
    if n_tokens > max_position_embeddings:
        return (f"the prompt has {n_tokens} tokens, more than the model's max_position_embeddings "
                f"({max_position_embeddings}); output past that length is unreliable")
    return None
