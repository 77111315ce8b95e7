"""Tiny random models of any MoE family in mlx-lm's own layout (`qnpipe make-tiny --family`).

The model is `qnpipe.model.family.tiny.build_random` of the family's tiny config, saved the way
`mlx_lm.convert` saves (`mlx_lm.utils.save_model` + `save_config`, quantized by
`mlx_lm.utils.quantize_model` with the family's own `quant_predicate`), so mlx-lm loads the
directory as it loads any converted model. The vocabulary is raised to the committed tokenizer's
1024 ids: a smaller embedding would let the tokenizer produce ids the model has no row for.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qnpipe.convert.tiny import TOKENIZER_DIR, TOKENIZER_FILES, TOKENIZER_VOCAB_SIZE, prepare_output
from qnpipe.errors import ConfigError
from qnpipe.io.outdir import atomic_dir

__all__ = ["MODES", "family_config", "make_tiny_family", "random_family_model"]

# Quantization modes and their fixed (group size, bits) where the mode fixes them (mlx-lm's defaults).
MODES: dict[str, tuple[int, int] | None] = {"affine": None, "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
# The tokenizer's special tokens (qnpipe/data/tokenizer): <|im_start|> and <|im_end|>.
BOS_ID, EOS_ID = 1, 2
_VOCAB_KEYS = ("vocab_size", "num_vocab", "vocab_size_per_layer_input")
# granitemoe's quant_predicate asks 8-bit group 64 of every `*mlp.down_proj`, the experts' too: their
# input must be 64 wide for `--bits` to run, as in every real granite checkpoint.
_OVERRIDES: dict[str, dict[str, Any]] = {"granitemoe": {"intermediate_size": 64}}


def family_config(family: str) -> dict[str, Any]:
    """The tiny config of `family` with its vocabulary raised to the tokenizer's and the special ids set."""
    from qnpipe.model.family.tiny import CONFIGS, tiny_config

    if family not in CONFIGS:
        raise ConfigError(f"make-tiny: no tiny model of family {family!r}; known: {', '.join(sorted(CONFIGS))}")
    config = tiny_config(family, **_OVERRIDES.get(family, {}))
    inner = config.get("text_config")
    for c in (config, inner) if isinstance(inner, dict) else (config,):
        for key in _VOCAB_KEYS:
            if isinstance(c.get(key), int) and c[key] < TOKENIZER_VOCAB_SIZE:
                c[key] = TOKENIZER_VOCAB_SIZE
    config.setdefault("bos_token_id", BOS_ID)
    config.setdefault("eos_token_id", EOS_ID)
    return config


def random_family_model(config: Mapping[str, Any], seed: int) -> Any:
    """mlx-lm's model of `config` with random float32 weights, deterministic per seed."""
    from qnpipe.model.family.tiny import build_random

    return build_random(copy.deepcopy(dict(config)), None, seed=seed)


def quantize_as_mlx_lm(model: Any, config: dict[str, Any], bits: int | None, group_size: int | None,
                       mode: str) -> dict[str, Any]:
    """Quantize `model` in place as `mlx_lm.convert -q` does; the config it would save ("quantization")."""
    from mlx_lm.utils import quantize_model

    fixed = MODES[mode]
    if fixed is not None:
        if (bits is not None and bits != fixed[1]) or (group_size is not None and group_size != fixed[0]):
            raise ConfigError(f"make-tiny: --mode {mode} is {fixed[1]}-bit with group size {fixed[0]} "
                              f"(got --bits {bits}, --group-size {group_size})")
        group_size, bits = fixed
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        _, quantized = quantize_model(model, config, group_size or 32, bits or 4, mode=mode)
    return quantized


def make_tiny_family(
    out_dir: str | os.PathLike[str],
    family: str,
    *,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    seed: int = 0,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write a tiny random model of `family` (a key of qnpipe.model.family.tiny.CONFIGS) in mlx-lm's
    layout with the committed tokenizer, and return its path.

    `bits` quantizes (affine, `group_size` default 32: the tiny experts are 32 wide); `mode` mxfp4,
    nvfp4 or mxfp8 quantizes with that mode's fixed bits and group size. Same seed, same bytes.
    `force` and `log` as `qnpipe.convert.tiny.make_tiny`.
    """
    if mode not in MODES:
        raise ConfigError(f"make-tiny: --mode must be one of {', '.join(MODES)}, got {mode!r}")
    quantized = bits is not None or mode != "affine"
    config = family_config(family)

    out = prepare_output(out_dir, force, log)

    from mlx_lm.utils import save_config, save_model

    model = random_family_model(config, seed)
    if quantized:
        config = quantize_as_mlx_lm(model, config, bits, group_size, mode)
    with atomic_dir(out, marker="qnpipe make-tiny") as build:
        save_model(build, model)
        save_config(config, build / "config.json")
        for f in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / f, build / f)
    return out
