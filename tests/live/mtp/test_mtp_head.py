"""The MTP head's forward against an independent float64 NumPy one, its loading, and its errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.errors import CheckpointError
from qnpipe.model.experts import ResidentExperts
from qnpipe.model.load import load_model
from qnpipe.model.mtp import load_mtp

TOOLS = Path(__file__).resolve().parents[3] / "tools"


def _numpy_mtp(lm: Any, model_dir: Path) -> Any:
    """tools/routing_stats.py's float64 MTP (written from the spec, independently of qnpipe.model.mtp)."""
    spec = importlib.util.spec_from_file_location("routing_stats", TOOLS / "routing_stats.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = json.loads((model_dir / "config.json").read_text())
    return mod.NumpyMTP({k: np.array(v) for k, v in lm.mtp_weights.items()},
                        np.array(lm.model.model.embed_tokens.weight), np.array(lm.model.lm_head.weight), cfg)


def test_mtp_logits_match_the_float64_reference_full_and_cached(trained_hf: Path) -> None:
    lm = load_model(trained_hf)
    head = load_mtp(lm.args, lm.mtp_weights, str(trained_hf))
    assert head is not None
    toks = mx.array([[int(t) for t in np.random.default_rng(1).integers(9, 4096, 24)]], dtype=mx.uint32)
    hidden = lm.model.model(toks)  # post-norm, as the model was trained
    T = toks.shape[1] - 1
    want = _numpy_mtp(lm, trained_hf)(np.array(hidden[0, :T]), np.array(toks[0, 1:]), np.arange(T, dtype=np.float64))
    full, _, _ = head(lm.model, hidden[:, :T], toks[:, 1:], head.make_cache())
    # The same rows through the KV cache: a 10-row prefill, then one row at a time.
    cache = head.make_cache()
    rows = [head(lm.model, hidden[:, :10], toks[:, 1:11], cache)[0][0]]
    rows += [head(lm.model, hidden[:, t:t + 1], toks[:, t + 1:t + 2], cache)[0][0] for t in range(10, T)]
    scale = np.abs(want).max()
    for got in (np.array(full[0]), np.array(mx.concatenate(rows))):
        assert np.abs(got - want).max() <= 1e-5 * scale
        assert (got.argmax(-1) == want.argmax(-1)).all()
    assert cache.offset == T
    # last_only: the last row's logits alone (what a draft reads), the same cache and hidden rows.
    lc, fc = head.make_cache(), head.make_cache()
    last, out_l, pre_l = head(lm.model, hidden[:, :T], toks[:, 1:], lc, last_only=True)
    _, out_f, pre_f = head(lm.model, hidden[:, :T], toks[:, 1:], fc)
    assert last.shape == (1, 1, full.shape[-1])
    assert np.abs(np.array(last[0, 0]) - want[-1]).max() <= 1e-5 * scale
    assert np.array_equal(np.array(out_l), np.array(out_f)) and np.array_equal(np.array(pre_l), np.array(pre_f))
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(lc.state, fc.state, strict=True))


def test_quantized_mtp_head_loads_and_drafts_like_the_float_one(trained_hf: Path, trained_qn4: Path) -> None:
    lm32, lm4 = load_model(trained_hf), load_model(trained_qn4)
    h32, h4 = load_mtp(lm32.args, lm32.mtp_weights, "f32"), load_mtp(lm4.args, lm4.mtp_weights, "q4")
    assert h32 is not None and h4 is not None
    assert h4.fc.bits == 4 and h4.fc.group_size == 32 and not hasattr(h32.fc, "bits")
    src = h4.mlp._experts
    assert isinstance(src, ResidentExperts)
    le = src.layers[lm4.args.num_hidden_layers]
    assert le.gate_proj.bits == 4 and le.down_proj.group_size == 32
    toks = mx.array([[int(t) for t in np.random.default_rng(2).integers(9, 4096, 64)]], dtype=mx.uint32)
    a = np.array(h32(lm32.model, lm32.model.model(toks)[:, :-1], toks[:, 1:], h32.make_cache())[0][0]).argmax(-1)
    b = np.array(h4(lm4.model, lm4.model.model(toks)[:, :-1], toks[:, 1:], h4.make_cache())[0][0]).argmax(-1)
    assert (a == b).mean() > 0.6  # 4-bit drafts mostly agree; exactness is the verifier's job


def test_no_mtp_weights_gives_no_head(trained_hf: Path) -> None:
    lm = load_model(trained_hf)
    assert load_mtp(lm.args, {}, "x") is None


@pytest.mark.parametrize(("edit", "msg"), [
    (lambda w: w.pop("mtp.fc.weight"), "missing tensor mtp.fc.weight"),
    (lambda w: w.pop("mtp.layers.0.mlp.experts.3.up_proj.weight"), "mtp.layers.0.mlp.experts.3.up_proj.weight"),
    (lambda w: w.__setitem__("mtp.norm.weight", mx.zeros((7,))), "mtp.norm.weight has shape [7]"),
    (lambda w: w.__setitem__("mtp.layers.0.extra.weight", mx.zeros((3,))), "unexpected tensor mtp.extra.weight"),
])
def test_bad_mtp_weights_name_the_tensor(trained_hf: Path, edit: Any, msg: str) -> None:
    lm = load_model(trained_hf)
    w = dict(lm.mtp_weights)
    edit(w)
    with pytest.raises(CheckpointError, match=msg.replace("[", r"\[").replace("]", r"\]")) as e:
        load_mtp(lm.args, w, "SRC/mtp.safetensors")
    assert "SRC/mtp.safetensors" in str(e.value)
