"""Issue 13, KV-cache quantization: the rotation, attention on the packed cache, bytes per token, the quality gate."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import qnpipe
from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.config import KvCfg
from qnpipe.errors import ConfigError
from qnpipe.model.kvquant import RotatedQuantizedKVCache, bytes_per_token, check_kv_cfg, rotation

# Qwen3-Next-80B-A3B's attention (/work/shared/docs/qwen3-next.md): 12 of 48 layers full attention,
# 2 KV heads of 256 dimensions, bf16.
FA_LAYERS, KV_HEADS, HEAD_DIM, BF16 = 12, 2, 256, 2


def test_rotation_is_a_fixed_block_diagonal_so4() -> None:
    r = rotation(32, seed=7)
    assert np.allclose(r @ r.T, np.eye(32), atol=1e-6)
    for b in range(0, 32, 4):
        assert np.isclose(np.linalg.det(r[b:b + 4, b:b + 4]), 1.0, atol=1e-5)
        off = np.delete(r[b:b + 4], np.s_[b:b + 4], axis=1)
        assert not off.any()  # nothing outside the 4x4 blocks
    assert np.array_equal(r, rotation(32, seed=7)) and not np.allclose(r, rotation(32, seed=8))


def _qkv(B: int = 1, Hq: int = 4, Hkv: int = 2, L: int = 5, D: int = 64, seed: int = 0) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))


@pytest.mark.parametrize(("rotate", "dtype"), [(True, "float32"), (False, "float32"), (True, "bfloat16")])
def test_attention_on_the_packed_cache_matches_float_attention(rotate: bool, dtype: str) -> None:
    """At 8 bits the quantized attention is float attention up to rounding: the rotation cancels."""
    q, k, v = _qkv()
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    c = RotatedQuantizedKVCache.from_cfg(KvCfg(quantize=True, k_bits=8, v_bits=8, group_size=64, rotate=rotate), 64)
    dt = getattr(mx, dtype)
    out = c.attend(q.astype(dt), k.astype(dt), v.astype(dt), scale=0.125, mask="causal")
    assert out.dtype == dt
    assert np.allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=2e-2 if dtype == "float32" else 6e-2)
    if dtype != "float32":
        return
    # Decoding one more token on top: the causal mask of a 1-token step is none.
    q1, k1, v1 = _qkv(L=1, seed=1)
    kk, vv = mx.concatenate([k, k1], axis=2), mx.concatenate([v, v1], axis=2)
    ref1 = mx.fast.scaled_dot_product_attention(q1, kk, vv, scale=0.125, mask=None)
    assert np.allclose(np.array(c.attend(q1, k1, v1, scale=0.125, mask=None)), np.array(ref1), atol=2e-2)
    assert c.offset == 6


def test_bytes_per_token_of_the_80b_shape() -> None:
    """The arithmetic, and the arrays the caches really hold for 300 tokens of the 80B attention shape."""
    q = KvCfg(quantize=True)  # K4 / V3, group 64
    plain = bytes_per_token(FA_LAYERS, KV_HEADS, HEAD_DIM, BF16, None)
    quant = bytes_per_token(FA_LAYERS, KV_HEADS, HEAD_DIM, BF16, q)
    # Per layer and token: K+V = 2 heads x 256 x 2 bytes x 2; quantized per head K 256*4/8 + V 256*3/8
    # bytes, plus a bf16 scale and bias per group of 64, for each.
    assert plain == 12 * 2 * (2 * 256 * 2) == 24576
    assert quant == 12 * 2 * ((128 + 4 * 2 * 2) + (96 + 4 * 2 * 2)) == 6144
    assert plain / quant == 4.0
    n = 300
    k = mx.zeros((1, KV_HEADS, n, HEAD_DIM), dtype=mx.bfloat16)
    c = RotatedQuantizedKVCache.from_cfg(q, HEAD_DIM)
    c.update_and_fetch(k, k)
    ref = KVCache()
    ref.update_and_fetch(k, k)
    assert c.nbytes * FA_LAYERS == quant * n
    assert (ref.keys.nbytes + ref.values.nbytes) * n // ref.keys.shape[2] * FA_LAYERS == plain * n  # type: ignore[union-attr]


def test_settings_that_do_not_fit_the_head_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"kv.group_size=64 must divide the model's head_dim 32 \(allowed here: 32\)"):
        check_kv_cfg(KvCfg(quantize=True), 32)
    with pytest.raises(ConfigError, match="kv.group_size=16"):
        check_kv_cfg(KvCfg(quantize=True, group_size=16), 32)
    with pytest.raises(ConfigError, match="group_size=64 must divide"):
        qnpipe.Engine(DEMO_MODEL_DIR, kv_quant=True)  # the trained tiny model's heads have 32 dimensions


PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n",
           "    def __init__(self, path):\n        self.path = path\n", "# Copyright 2001\n\"\"\"Utilities for URLs.\"\"\"\n"]


@pytest.mark.slow
def test_quality_gate_on_the_trained_model() -> None:
    """K4/V3: >= 95% greedy agreement and logits cosine >= 0.99 over 4 x 64 tokens, next to mlx-lm at 4/4."""
    from qnpipe.chat.tokenizer import encode, load_tokenizer
    from qnpipe.model import kv_quality
    from qnpipe.model.load import load_model

    model = load_model(DEMO_MODEL_DIR).model
    tok = load_tokenizer(DEMO_MODEL_DIR)
    ids = [encode(tok, p) for p in PROMPTS]
    res = kv_quality.quality_gate(model, ids, 64, kv_quality.variants(model, [(4, 3), (4, 4)], group_size=32),
                                  block=16)
    print({k: (round(a, 4), round(c, 5)) for k, (a, c) in res.items()})
    assert set(res) == {"qnpipe 4/3", "qnpipe 4/4", "mlx-lm 4/4"}
    agree, cos = res["qnpipe 4/3"]
    assert agree >= 0.95 and cos >= 0.99
    # At the bits mlx-lm can do, qnpipe's cache is as good (both well above the gate).
    assert res["qnpipe 4/4"][1] >= 0.99 and res["mlx-lm 4/4"][1] >= 0.99
    assert res["qnpipe 4/4"][0] >= res["mlx-lm 4/4"][0] - 0.03


@pytest.mark.slow
def test_engine_with_kv_quant_and_snapshots_is_exact(tmp_path: object) -> None:
    """The quantized cache snapshots and resumes bit for bit (in memory and through the directory)."""
    text = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point.\"\"\"\n    return len(argv)\n"
    kw = {"kv_quant": True, "group_size": 32, "snapshot_head_tokens": 16, "snapshot_dir": str(tmp_path)}
    with qnpipe.Engine(DEMO_MODEL_DIR, **kw) as eng:
        first = eng.next_logits(text)
        again = eng.next_logits(text)
        toks = eng.generate(text, max_tokens=24, stop_at_eos=False).tokens
        st = eng.stats()
    assert st.prefix is not None and st.prefix.hits == 2 and st.kv_bytes_per_token > 0
    assert np.array_equal(first, again)
    with qnpipe.Engine(DEMO_MODEL_DIR, **kw) as eng:  # another engine: the head from its file
        assert np.array_equal(eng.next_logits(text), first)
        assert eng.generate(text, max_tokens=24, stop_at_eos=False).tokens == toks
        assert eng.stats().prefix.disk_loads == 1  # type: ignore[union-attr]
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=0) as eng:
        plain = eng.next_logits(text)
        plain_bytes = eng.stats().kv_bytes_per_token
    assert not np.array_equal(plain, first)  # quantization is on
    assert plain_bytes / st.kv_bytes_per_token > 5  # fp32 heads of 32 dims: 256 vs 44 bytes per head and token
