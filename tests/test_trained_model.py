"""The shipped trained tiny Qwen3-Next (qnpipe/data/tiny_trained, made by tools/train_tiny.py).

Loaded from the installed package's location, as `qnpipe demo` finds it.
"""

from __future__ import annotations

import json
import struct
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

CODE_PROMPT = '''import os


def read_lines(path):
    """Return the lines of the file at path."""
    with open(path) as f:
'''

ROUND_TRIP = [
    CODE_PROMPT,
    "class Foo(Bar):\n\tdef __init__(self, *args, **kw) -> None:\n\t\tsuper().__init__(*args, **kw)  # tab-indented\n",
    "x = {'a': [1, 2.5e-3, 0x1F], \"b\": None}\r\nprint(f\"{x!r:>10}\")\n",
    "Ünïcödé — 日本語 🐍\n    \n\n  trailing spaces   ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    d = Path(str(resources.files("qnpipe") / "data" / "tiny_trained"))
    assert (d / "config.json").is_file(), f"shipped model missing at {d}"
    return d


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_shipped_files_layout_and_size(model_dir: Path) -> None:
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "MODEL_CARD.md"):
        assert (model_dir / f).is_file(), f
    total = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    assert total <= 30 * 10**6
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next"
    assert cfg["num_experts"] >= 32 and cfg["num_experts_per_tok"] >= 4
    assert cfg["shared_expert_intermediate_size"] > 0
    kinds = [(layer + 1) % cfg["full_attention_interval"] != 0 for layer in range(cfg["num_hidden_layers"])]
    assert kinds.count(True) >= 2 and kinds.count(False) >= 2
    hdr = _header(model_dir / "model.safetensors")
    names = set(hdr) - {"__metadata__"}
    # original HF layout: per-expert tensors, conv [C, 1, K], one MTP layer with its own experts
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in names
    assert hdr["model.layers.0.linear_attn.conv1d.weight"]["shape"][1] == 1
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= names
    assert f"mtp.layers.0.mlp.experts.{cfg['num_experts'] - 1}.down_proj.weight" in names
    assert all(v["dtype"] == "F32" for k, v in hdr.items() if k != "__metadata__")


def test_logits_match_mlx_lm(model_dir: Path) -> None:
    from mlx_lm.utils import load_model as mlx_lm_load
    from tokenizers import Tokenizer

    from qnpipe.model.load import load_model

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CODE_PROMPT, add_special_tokens=False).ids
    assert len(ids) > 16
    x = mx.array(ids)[None]
    lm = load_model(model_dir)
    assert lm.mtp_weights  # the MTP is kept aside, not dropped
    ours = np.array(lm.model(x)[0].astype(mx.float32))
    ref_model, _ = mlx_lm_load(model_dir)
    ref = np.array(ref_model(x)[0].astype(mx.float32))
    assert ours.shape == ref.shape == (len(ids), lm.args.vocab_size)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


def test_tokenizer_round_trips_code_and_specials(model_dir: Path) -> None:
    from qnpipe.chat.tokenizer import encode, load_tokenizer, render_chat

    tok = load_tokenizer(model_dir)
    for text in ROUND_TRIP:
        ids = encode(tok, text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert encode(tok, "<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    assert 2 in tok.eos_token_ids
    prompt = render_chat(tok, [{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # a trained BPE: code compresses well below one token per byte
    assert len(encode(tok, CODE_PROMPT)) < len(CODE_PROMPT.encode()) / 2.5


def _code_like(text: str) -> bool:
    return any(s in text for s in ("(", ":", "=", "\n    ", "\n\t"))


def test_greedy_generation_is_code_like(model_dir: Path) -> None:
    import qnpipe

    with qnpipe.Engine(model_dir, prefill_chunk_tokens=0) as eng:
        res = eng.generate(CODE_PROMPT, max_tokens=48, temperature=0.0)
        again = eng.generate(CODE_PROMPT, max_tokens=48, temperature=0.0)
        chat = eng.generate("<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n"
                            "<|im_start|>assistant\n", max_tokens=48, temperature=0.0)
    assert res.tokens == again.tokens  # greedy is deterministic
    assert len(res.tokens) >= 8
    assert _code_like(res.text), res.text
    assert _code_like(chat.text), chat.text
