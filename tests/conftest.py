"""Shared fixtures: tiny Qwen3-Next model directories made locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (qwen3-next.md §8, vocab 1024) in the original HF layout, fp32."""
    from qnpipe.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-hf", layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_mlx4(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    """`tiny_hf` converted by mlx-lm's own `convert` to 4-bit / group 64, bf16 scales."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("models") / "tiny-mlx4"
    convert(hf_path=str(tiny_hf), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    return out
