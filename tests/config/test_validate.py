"""Issue 8 at the API level: argument checks (qnpipe.config.validate), config ranges, loader refusals."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from qnpipe.config.validate import check_generate_args, check_prompt, check_topk_override, context_warning
from qnpipe.errors import CheckpointError, ConfigError, OutputError, QnpipeError, TokenizerError
from qnpipe.model.args import args_from_dict, read_config


@pytest.mark.parametrize("prompt, needle", [
    (b"abc", "bytes"), (bytearray(b"a"), "bytearray"), ([1, 2.0], "prompt[1]"), ([1.5], "prompt[0]"),
    ([True], "prompt[0]"), (["1"], "prompt[0]"), ([], "empty"), ("", "empty"), ([3, -1], "negative"),
    ("caf\udce9", "UTF-8"), (None, "NoneType"), (7, "int"),
])
def test_bad_prompts_name_the_argument(prompt, needle: str) -> None:
    with pytest.raises(ValueError, match="prompt") as e:
        check_prompt(prompt)
    assert needle in str(e.value)


def test_good_prompts_pass_through() -> None:
    assert check_prompt("hi") == "hi"
    assert check_prompt([1, 2]) == [1, 2]
    assert check_prompt(np.array([4, 5])) == [4, 5]
    assert check_prompt((np.int32(3),)) == [3]


@pytest.mark.parametrize("kw, needle", [
    ({"max_tokens": -5}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"top_p": 2}, "top_p"), ({"top_p": math.nan}, "top_p"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": -1}, "temperature"), ({"temperature": math.inf}, "temperature"), ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"), ({"top_p": "0.5"}, "top_p"),
])
def test_bad_generate_args_name_the_argument(kw: dict, needle: str) -> None:
    args = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None} | kw
    with pytest.raises(ValueError, match=needle):
        check_generate_args([1, 2], **args)


def test_good_generate_args() -> None:
    check_generate_args("x", max_tokens=0, temperature=0.7, top_p=1, seed=2**63)


def test_topk_override_range_and_context_warning() -> None:
    check_topk_override(None, 64)
    check_topk_override(64, 64)
    with pytest.raises(ConfigError, match=r"moe_topk_override=65: must be in 1\.\.64"):
        check_topk_override(65, 64)
    assert context_warning(5, 5) is None
    assert "max_position_embeddings (4)" in (context_warning(5, 4) or "")


def _config(tiny_hf: Path, **changes) -> dict:
    return read_config(tiny_hf) | changes


@pytest.mark.parametrize("key, value, needle", [
    ("num_experts_per_tok", 0, "num_experts_per_tok is 0"),
    ("num_experts_per_tok", 65, "num_experts_per_tok is 65; it must be in 1..num_experts (64)"),
    ("full_attention_interval", 0, "full_attention_interval is 0"),
    ("hidden_size", 0, "hidden_size is 0"),
    ("num_key_value_heads", 0, "num_key_value_heads is 0"),
    ("vocab_size", -1, "vocab_size is -1"),
    ("decoder_sparse_step", 0, "decoder_sparse_step is 0"),
    ("moe_intermediate_size", 0, "moe_intermediate_size is 0"),
    ("rms_norm_eps", 0.0, "rms_norm_eps is 0.0"),
    ("partial_rotary_factor", 1.5, "partial_rotary_factor is 1.5"),
    ("mlp_only_layers", [99], "mlp_only_layers has 99"),
])
def test_impossible_configs_name_key_and_value(tiny_hf: Path, key: str, value, needle: str) -> None:
    with pytest.raises(CheckpointError, match="cfg.json") as e:
        args_from_dict(_config(tiny_hf, **{key: value}), "cfg.json")
    assert needle in str(e.value)


def test_missing_model_type_says_missing(tiny_hf: Path) -> None:
    raw = read_config(tiny_hf)
    del raw["model_type"]
    with pytest.raises(CheckpointError, match="model_type is missing"):
        args_from_dict(raw, "cfg.json")


def test_a_file_as_model_dir(tiny_hf: Path) -> None:
    with pytest.raises(CheckpointError, match="is a file, not a model directory"):
        read_config(tiny_hf / "config.json")


def test_bf16_experts_refused_on_cpu_before_loading(tmp_path: Path) -> None:
    import mlx.core as mx

    from qnpipe.convert.tiny import make_tiny
    from qnpipe.model.load import load_model

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the refusal applies to the CPU backend only")
    d = make_tiny(tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(CheckpointError, match=r"unquantized bfloat16 .*--dtype float32.*--bits 4"):
        load_model(d)
    with pytest.raises(CheckpointError, match=r"unquantized bfloat16 .*switch_mlp"):
        load_model(make_tiny(tmp_path / "bf16mlx", dtype="bfloat16", layout="mlx"))
    from qnpipe.convert import convert

    qn = tmp_path / "qn"
    convert(d, qn, mtp_bits=0)  # a qnpipe store of bf16 experts
    with pytest.raises(CheckpointError, match=r"unquantized bfloat16 .*layer_000\.bin"):
        load_model(qn)
    qn32 = tmp_path / "qn32"
    convert(d, qn32, dtype="float32", mtp_bits=0)  # the conversion the message suggests
    load_model(qn32)
    load_model(make_tiny(tmp_path / "bf16q", dtype="bfloat16", layout="mlx", bits=4))  # quantized: runs


def test_loader_checks_topk_override(tiny_hf: Path) -> None:
    from qnpipe.model.load import load_model

    with pytest.raises(ConfigError, match="moe_topk_override=65"):
        load_model(tiny_hf, topk_override=65)


def test_tokenizer_config_without_tokenizer_json(tmp_path: Path, tiny_hf: Path) -> None:
    from qnpipe.chat.tokenizer import load_tokenizer

    d = tmp_path / "m"
    shutil.copytree(tiny_hf, d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        load_tokenizer(d)


def test_unwritable_output_locations(tmp_path: Path) -> None:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError, match=rf"{f}.* is not a directory"):
        make_tiny(f / "out")
    with pytest.raises(OutputError, match="/proc/qn.*cannot write there"):
        make_tiny("/proc/qn")
    with pytest.raises(QnpipeError, match="/proc/qn.*cannot write there"):
        convert(tmp_path, "/proc/qn")  # refused before the source is even read


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory(tmp_path: Path) -> None:
    from qnpipe.convert.tiny import make_tiny

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputError, match=rf"{ro}.*(permission|read-only)"):
            make_tiny(ro / "out")
    finally:
        ro.chmod(0o755)


def test_toml_not_utf8(tmp_path: Path) -> None:
    from qnpipe import config

    p = tmp_path / "c.toml"
    p.write_bytes(b'[read]\nbackend = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=rf"{p} is not valid UTF-8 \(byte 0xe9"):
        config.load(p, env={})


def test_store_index_json_still_reads(tiny_qn4: Path) -> None:
    """The qnpipe store's config.json passes the new range checks (a regression guard)."""
    args_from_dict(json.loads((tiny_qn4 / "config.json").read_text()))
