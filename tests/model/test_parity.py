"""qnpipe's Qwen3-Next forward and greedy generation against mlx-lm's reference model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load

import qnpipe
from qnpipe.model.load import load_model


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _ref_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    ref, _ = mlx_lm_load(model_dir)
    out = ref(mx.array(tokens)[None])
    return np.array(out[0].astype(mx.float32))


def _ref_greedy(model_dir: Path, tokens: list[int], n: int) -> list[int]:
    ref, _ = mlx_lm_load(model_dir)
    gen = generate_step(mx.array(tokens), ref, max_tokens=n)
    return [int(t) for t, _ in gen]


def test_fp32_hf_logits_match_mlx_lm(tiny_hf: Path) -> None:
    toks = _prompt(64, 1024)
    ours = load_model(tiny_hf).model(mx.array(toks)[None])[0]
    ours = np.array(ours.astype(mx.float32))
    ref = _ref_logits(tiny_hf, toks)
    assert ours.shape == (64, 1024)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    # Same kernels in the same order: the aim, and what capacity invariance builds on.
    assert np.array_equal(ours, ref)


@pytest.mark.slow
def test_4bit_mlx_converted_logits_match_mlx_lm(tiny_mlx4: Path) -> None:
    toks = _prompt(64, 1024, seed=1)
    lm = load_model(tiny_mlx4)
    assert lm.layout == "mlx"
    assert lm.experts.layers[0].gate_proj.bits == 4
    ours = np.array(lm.model(mx.array(toks)[None])[0].astype(mx.float32))
    ref = _ref_logits(tiny_mlx4, toks)
    assert np.abs(ours - ref).max() <= 1e-2 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
    assert np.array_equal(ours, ref)


def test_engine_logits_are_fresh_sequence_float32(tiny_hf: Path) -> None:
    toks = _prompt(16, 1024, seed=2)
    with qnpipe.Engine(tiny_hf, prefill_chunk_tokens=0) as eng:
        a = eng.logits(toks)
        b = eng.logits(toks)  # no state carried over from the first call
    assert a.dtype == np.float32 and a.shape == (16, 1024)
    assert np.array_equal(a, b)
    assert np.array_equal(a, _ref_logits(tiny_hf, toks))


def test_greedy_32_tokens_identical_to_mlx_lm(tiny_hf: Path) -> None:
    toks = _prompt(12, 1024, seed=3)
    ref = _ref_greedy(tiny_hf, toks, 32)
    with qnpipe.Engine(tiny_hf) as eng:
        res = eng.generate(toks, max_tokens=32, stop_at_eos=False)
    assert list(res.tokens) == ref
    assert res.stats.generated_tokens == 32


@pytest.mark.parametrize(
    "over",
    [
        {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2},
        {"num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
         "linear_num_key_heads": 1, "linear_num_value_heads": 3, "num_experts": 8, "num_experts_per_tok": 8},
        {"num_hidden_layers": 5, "full_attention_interval": 5, "head_dim": 64, "num_experts": 32,
         "num_experts_per_tok": 6, "vocab_size": 1536, "moe_intermediate_size": 32, "hidden_size": 64},
    ],
    ids=["3L-fai3-e16k2", "4L-fai2-gqa4-r3-e8k8", "5L-fai5-hd64-e32k6-v1536"],
)
def test_other_shapes_match_mlx_lm(tmp_path: Path, over: dict) -> None:
    from qnpipe.convert.tiny import make_tiny

    d = make_tiny(tmp_path / "m", layout="hf", seed=7, config_overrides=over)
    vocab = over.get("vocab_size", 1024)
    toks = _prompt(24, vocab, seed=4)
    lm = load_model(d)
    ours = np.array(lm.model(mx.array(toks)[None])[0].astype(mx.float32))
    ref = _ref_logits(d, toks)
    assert np.array_equal(ours, ref)  # docs/model.md: bit-identical for these shapes too
    with qnpipe.Engine(d) as eng:
        res = eng.generate(toks, max_tokens=12, stop_at_eos=False)
    assert list(res.tokens) == _ref_greedy(d, toks, 12)
