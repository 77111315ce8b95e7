"""Tiny model directories: layouts, determinism, tokenizer and chat template."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from safetensors import safe_open

from qnpipe.convert.tiny import TINY_CONFIG, TOKENIZER_DIR, make_tiny, random_hf_weights
from qnpipe.errors import OutputError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    },
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "tool", "content": '{"temp": 15}'},
]
# The Qwen3-2507-Instruct template (docs/model.md, "Chat template and special tokens"), verbatim.
RENDERED = """<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Zürich?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Zürich"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temp": 18}
</tool_response>
<tool_response>
{"temp": 15}
</tool_response><|im_end|>
<|im_start|>assistant
"""
CODE = (
    'def f(xs: list[int]) -> int:\n    """Sum."""\n    return sum(x * 2 for x in xs)  # doubled\n\n'
    "\tprint(f([1, 2]))\r\n"
)
NON_ASCII = "Grüße aus Zürich — naïve café ☕, 日本語, emoji 😀, ﬁ, Ω≈ç√"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "hf": make_tiny(root / "hf", seed=0),
        "hf_again": make_tiny(root / "hf_again", seed=0),
        "hf_seed1": make_tiny(root / "hf_seed1", seed=1),
        "sharded": make_tiny(root / "sharded", shards=3, dtype="bfloat16"),
        "mlx4": make_tiny(root / "mlx4", layout="mlx", bits=4),
    }


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), "np") as f:
        return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def _tokenizer(path: Path) -> TokenizerWrapper:
    from mlx_lm.tokenizer_utils import load

    return load(path)


def test_hf_config_and_files(dirs: dict[str, Path]) -> None:
    d = dirs["hf"]
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert config["rope_theta"] == 10000000 and config["partial_rotary_factor"] == 0.25
    assert config["norm_topk_prob"] is True and config["mtp_num_hidden_layers"] == 1
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (1024, 1, 2)
    assert config["torch_dtype"] == "float32"
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (d / f).read_bytes() == (TOKENIZER_DIR / f).read_bytes()
        assert (TOKENIZER_DIR / f).stat().st_size < 100_000
    header = _header(d / "model.safetensors")
    assert len(header) == 1858  # docs/model.md, "Tiny test configuration"
    assert header["model.layers.0.linear_attn.conv1d.weight"] == ("F32", (256, 1, 4))
    assert header["model.layers.3.self_attn.q_proj.weight"][1] == (512, 128)
    assert header["model.layers.7.mlp.experts.63.down_proj.weight"][1] == (128, 64)
    assert header["mtp.fc.weight"][1] == (128, 256)
    assert header["mtp.layers.0.mlp.experts.0.gate_proj.weight"][1] == (64, 128)
    assert not any(k.startswith("model.layers.8.") for k in header)


def test_hf_dir_loads_and_runs(dirs: dict[str, Path]) -> None:
    from mlx_lm.utils import load_model

    model, _ = load_model(dirs["hf"])
    logits = model(mx.array([[1, 50, 60, 70, 2]]))
    assert logits.shape == (1, 5, 1024)
    assert bool(mx.all(mx.isfinite(logits)).item())
    assert float(logits.std().item()) > 0.5  # not a near-uniform distribution


def test_routing_is_not_degenerate() -> None:
    w = random_hf_weights(TINY_CONFIG, seed=0)
    x = w["model.embed_tokens.weight"][np.arange(9, 1024, 7)]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1 + w["model.layers.0.post_attention_layernorm.weight"])
    logits = x @ w["model.layers.0.mlp.gate.weight"].T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(p, -1)[:, ::-1][:, :4]
    top /= top.sum(-1, keepdims=True)
    assert 0.3 < top[:, 0].mean() < 0.8
    chosen = np.argsort(-logits, -1)[:, :4]
    assert len(np.unique(chosen)) > 48
    gate = 1 / (1 + np.exp(-(x @ w["model.layers.0.mlp.shared_expert_gate.weight"].T)))
    assert gate.min() < 0.3 and gate.max() > 0.7


def test_other_config_shape(tmp_path: Path) -> None:
    from mlx_lm.utils import load_model

    overrides = {
        "vocab_size": 1040,
        "num_hidden_layers": 2,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    d = make_tiny(tmp_path / "m", config_overrides=overrides, seed=3)
    header = _header(d / "model.safetensors")
    assert header["model.layers.1.self_attn.q_proj.weight"][1] == (512, 128)
    assert header["model.layers.0.linear_attn.in_proj_qkvz.weight"][1] == (384, 128)
    assert header["model.layers.0.linear_attn.conv1d.weight"][1] == (256, 1, 4)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in header
    assert "model.layers.0.mlp.experts.8.up_proj.weight" not in header
    w = random_hf_weights({**TINY_CONFIG, **overrides}, seed=3)
    assert not w["lm_head.weight"][1024:].any()  # padding rows
    model, _ = load_model(d)
    assert model(mx.array([[3, 4, 5]])).shape == (1, 3, 1040)


def test_tokenizer_round_trip_and_special_ids(dirs: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    tok = _tokenizer(dirs["hf"])
    raw = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    assert raw.get_vocab_size() == 1024
    for text in (CODE, NON_ASCII):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text) == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.eos_token_ids == {2}
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    tool_tokens = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    assert tok.convert_tokens_to_ids(tool_tokens) == [3, 4, 5, 6, 7, 8]
    assert tok.decode([1, 3, 2], skip_special_tokens=True) == "<tool_call>"


def test_chat_template(dirs: dict[str, Path]) -> None:
    for d in (dirs["hf"], dirs["mlx4"]):
        tok = _tokenizer(d)
        assert tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False) == RENDERED
        hi = [{"role": "user", "content": "Hi"}]
        minimal = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
        assert minimal == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"


def test_determinism(dirs: dict[str, Path]) -> None:
    a = (dirs["hf"] / "model.safetensors").read_bytes()
    assert a == (dirs["hf_again"] / "model.safetensors").read_bytes()
    assert a != (dirs["hf_seed1"] / "model.safetensors").read_bytes()


def test_sharded_bf16(dirs: dict[str, Path]) -> None:
    from mlx_lm.utils import load_model

    d = dirs["sharded"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (d / "model.safetensors").exists()
    seen: dict[str, str] = {}
    total = 0
    for f in files:
        for name, (dtype, shape) in _header(d / f).items():
            assert dtype == "BF16"
            seen[name] = f
            total += 2 * int(np.prod(shape))
    assert seen == index["weight_map"] and len(seen) == 1858
    assert index["metadata"]["total_size"] == total
    expert_files: dict[str, set[str]] = defaultdict(set)
    for name, f in seen.items():
        if ".mlp.experts." in name:
            expert_files[name.split(".mlp.experts.")[0]].add(f)
    assert any(len(v) > 1 for v in expert_files.values())
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = load_model(d)
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 1024)


def test_mlx_layout_quantized(dirs: dict[str, Path]) -> None:
    from mlx_lm.utils import load_model

    d = dirs["mlx4"]
    config = json.loads((d / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    names: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in sorted(d.glob("*.safetensors")):
        names.update(_header(f))
    assert "model.layers.0.mlp.switch_mlp.gate_proj.scales" in names
    assert names["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == ("U32", (64, 64, 16))
    assert not any(k.startswith("mtp.") or ".experts." in k for k in names)
    model, _ = load_model(d)
    logits = model(mx.array([[1, 50, 60]]))
    assert logits.shape == (1, 3, 1024) and bool(mx.all(mx.isfinite(logits)).item())


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    small = {"num_hidden_layers": 1, "num_experts": 2, "num_experts_per_tok": 1}
    with pytest.raises(FileExistsError, match=str(d)):
        make_tiny(d, config_overrides=small)
    with pytest.raises(OutputError, match="not a qnpipe output"):  # force replaces only what qnpipe wrote
        make_tiny(d, force=True, config_overrides=small)
    assert (d / "keep.txt").exists()
    (d / "keep.txt").unlink()
    make_tiny(d, config_overrides=small)
    make_tiny(d, force=True, seed=1, config_overrides=small)
    assert (d / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directories left behind


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny(tmp_path / "v", config_overrides={"vocab_size": 512})
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "b", bits=4)  # quantisation needs the mlx layout
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "d", dtype="float16")
    assert not any(tmp_path.iterdir())
