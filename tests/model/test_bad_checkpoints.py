"""Broken model directories fail with errors that name the file, tensor or key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from qnpipe.errors import CheckpointError
from qnpipe.model.checkpoint import load_safetensors
from qnpipe.model.load import load_model


@pytest.fixture
def broken(tmp_path: Path, tiny_hf: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_hf, d)
    return d


def _weights_file(d: Path) -> Path:
    files = sorted(d.glob("model*.safetensors"))
    assert len(files) == 1
    return files[0]


def _rewrite(d: Path, edit) -> None:
    f = _weights_file(d)
    w = load_file(str(f))
    edit(w)
    save_file(w, str(f))


def test_missing_tensor_is_named(broken: Path) -> None:
    _rewrite(broken, lambda w: w.pop("model.layers.2.linear_attn.out_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.linear_attn\.out_proj\.weight"):
        load_model(broken)


def test_missing_expert_is_named(broken: Path) -> None:
    _rewrite(broken, lambda w: w.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(broken)


def test_wrong_shape_names_tensor_file_and_shapes(broken: Path) -> None:
    def edit(w):
        w["model.layers.3.self_attn.k_proj.weight"] = w["model.layers.3.self_attn.k_proj.weight"][:-1]

    _rewrite(broken, edit)
    with pytest.raises(CheckpointError) as e:
        load_model(broken)
    msg = str(e.value)
    assert "model.layers.3.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "[63, 128]" in msg and "[64, 128]" in msg


def test_wrong_expert_shape_is_named(broken: Path) -> None:
    def edit(w):
        w["model.layers.0.mlp.experts.9.down_proj.weight"] = w["model.layers.0.mlp.experts.9.down_proj.weight"][:, :-2]

    _rewrite(broken, edit)
    with pytest.raises(CheckpointError, match=r"experts\.9\.down_proj\.weight has shape \[128, 62\]"):
        load_model(broken)


def test_unexpected_tensor_is_named(broken: Path) -> None:
    def edit(w):
        w["model.layers.0.linear_attn.bogus.weight"] = w["model.norm.weight"]

    _rewrite(broken, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.linear_attn\.bogus\.weight"):
        load_model(broken)


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_safetensors_file(broken: Path, keep: int) -> None:
    f = _weights_file(broken)
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated safetensors file"):
        load_model(broken)


def test_corrupt_header(broken: Path) -> None:
    f = _weights_file(broken)
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe\x00{"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        load_model(broken)


def test_wrong_model_type(broken: Path) -> None:
    # Any MoE family mlx-lm builds runs (the generic tier); a type mlx-lm does not know is named.
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "nosuch_moe"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'nosuch_moe' is not a model mlx-lm"):
        load_model(broken)


def test_dense_model_type(broken: Path) -> None:
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "qwen3"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"a qwen3 model has no routed experts"):
        load_model(broken)


def test_missing_config_key(broken: Path) -> None:
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["num_experts"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: missing required key\(s\) num_experts"):
        load_model(broken)


def test_no_weights_and_not_a_model_dir(tmp_path: Path, broken: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_model(tmp_path / "nothing")
    _weights_file(broken).unlink()
    with pytest.raises(CheckpointError, match=r"no model\*\.safetensors weight files"):
        load_model(broken)


def test_neither_layout(broken: Path) -> None:
    _rewrite(broken, lambda w: [w.pop(k) for k in list(w) if ".mlp.experts." in k])
    with pytest.raises(CheckpointError, match=r"neither an original Hugging Face"):
        load_model(broken)


def test_index_naming_missing_shard(broken: Path) -> None:
    f = _weights_file(broken)
    names = list(load_file(str(f)))
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "model-00002-of-00002.safetensors" for n in names}})
    )
    with pytest.raises(CheckpointError, match=r"lists shard model-00002-of-00002\.safetensors, which is missing"):
        load_model(broken)


def test_quantized_expert_shape_mismatch_names_bits(tmp_path: Path, tiny_mlx4: Path) -> None:
    import mlx.core as mx

    d = tmp_path / "q"
    shutil.copytree(tiny_mlx4, d)
    f = _weights_file(d)
    w = dict(load_safetensors(f))
    name = "model.layers.2.mlp.switch_mlp.down_proj.biases"
    w[name] = w[name][:, :-1]
    mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
    with pytest.raises(CheckpointError, match=r"down_proj\.biases has shape \[64, 127, 1\], expected \[64, 128, 1\] \(4-bit, group size 64\)"):
        load_model(d)
