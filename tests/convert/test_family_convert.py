"""`qnpipe convert` of mlx-lm directories of other MoE families: records are the source stacks' slices byte for
byte, the non-expert file holds exactly the rest, the index's family block names the switches, and the converted
directory rebuilds the source model exactly. Bad input is refused by name before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model

from qnpipe.cli import main
from qnpipe.convert import convert
from qnpipe.convert.verify import verify_store
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.io.store import ExpertStore
from qnpipe.io.store_format import index_family
from qnpipe.model.family import tiny
from qnpipe.model.family.skeleton import skeleton_id
from qnpipe.model.family.store_spec import converted_skeleton
from qnpipe.model.family.switches import expert_params, find_switches, num_experts

CASES = [("qwen3_moe", None), ("gpt_oss", None), ("gpt_oss", "affine4"), ("gpt_oss", "mxfp4"),
         ("deepseek_v3", None), ("glm4_moe", "affine4"), ("qwen3_5_moe", None), ("minimax", None),
         ("llama4", None), ("mixtral", None)]


def save_mlx_dir(d: Path, family: str, quant: str | None = None, **overrides: Any) -> tuple[Path, Any]:
    """A tiny random model of `family` saved as mlx-lm saves one (post-sanitize weights, its config)."""
    cfg = tiny.tiny_config(family, **overrides)
    model = tiny.build_random(cfg, quant)
    d.mkdir(parents=True)
    save_model(d, model)
    if quant is not None:
        cfg["quantization"] = dict(tiny.QUANTS[quant])
    save_config(cfg, d / "config.json")
    (d / "tokenizer_config.json").write_text("{}")
    return d, model


def _load(path: Path) -> dict[str, mx.array]:
    out = mx.load(str(path))
    assert isinstance(out, dict)
    return out


def _bytes(a: Any) -> bytes:
    a = mx.array(a)
    return bytes(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes())


@pytest.mark.parametrize("family, quant", CASES, ids=[f"{f}-{q or 'float'}" for f, q in CASES])
def test_family_convert_is_the_source_re_laid_out(tmp_path: Path, family: str, quant: str | None) -> None:
    src, model = save_mlx_dir(tmp_path / "src", family, quant)
    out = tmp_path / "qn"
    if family == "gpt_oss" and quant == "mxfp4":  # through the CLI entry once
        assert main(["convert", str(src), "--out", str(out), "--json"]) == 0
    else:
        report = convert(src, out)
        assert report.num_experts == num_experts(find_switches(model)[0].module)
    sites = find_switches(model)
    src_params = dict(tree_flatten(model.parameters()))
    expert_names = {f"{s.path}.{n}" for s in sites for n in expert_params(s.module)}

    with ExpertStore.open(out) as store:
        fam = index_family(store.index)
        assert store.index.version == 2
        assert (fam.model_type, fam.switch_class) == (json.loads((src / "config.json").read_text())["model_type"],
                                                     type(sites[0].module).__name__)
        assert fam.switch_paths == {s.layer: s.path for s in sites}
        for s in sites:
            lf = store.layer_file(s.layer)
            assert [t.name for t in lf.tensors] == list(expert_params(s.module))
            for e in range(lf.num_experts):
                rec = store.record_tensors(s.layer, store.read_record(s.layer, e, verify=True))
                for name, stack in expert_params(s.module).items():
                    assert rec[name].tobytes() == _bytes(stack[e]), (s.layer, e, name)
    assert verify_store(out).ok

    main_file = {k: v for f in sorted(out.glob("model*.safetensors")) for k, v in _load(f).items()}
    assert set(main_file) == set(src_params) - expert_names
    assert all(_bytes(main_file[k]) == _bytes(src_params[k]) for k in main_file)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["qnpipe"]["family"]["model_type"] == fam.model_type and cfg["qnpipe"]["experts"]["store_version"] == 2
    assert (out / "tokenizer_config.json").is_file()

    rebuilt, index, config = converted_skeleton(out)  # the engine's view: skeleton + strict load + the store
    assert index.model_id == skeleton_id(config, rebuilt)
    with ExpertStore.open(out) as store:
        experts = [(f"{fam.switch_paths[layer]}.{n}", mx.array(a) if a.dtype != np.uint16 else
                    mx.array(a).view(mx.bfloat16)) for layer in store.layers for n, a in store.read_layer(layer).items()]
    rebuilt.load_weights(list(main_file.items()) + experts, strict=True)
    got = dict(tree_flatten(rebuilt.parameters()))
    assert set(got) == set(src_params)
    for k, v in src_params.items():
        assert got[k].dtype == v.dtype and _bytes(got[k]) == _bytes(v), k


def _no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("a weight was read before the input was refused")

    monkeypatch.setattr("qnpipe.convert.family.read_tensor", refuse)
    monkeypatch.setattr("qnpipe.convert.plan.read_tensor", refuse)


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def qwen3_moe_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_mlx_dir(tmp_path_factory.mktemp("bad") / "src", "qwen3_moe")[0]


def _copy(src: Path, tmp: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, tmp / "src"))


@pytest.mark.parametrize("edit, error, match", [
    (dict(model_type="nosuch_moe"), CheckpointError, r"model_type 'nosuch_moe' is not a model mlx-lm .* knows"),
    (dict(model_file="evil.py"), CheckpointError, r"config.json asks to import model code \('evil.py'\)"),
    (dict(mlp_only_layers=[0, 1, 2]), CheckpointError, r"a qwen3_moe model has no routed experts"),
    (dict(moe_intermediate_size=48), CheckpointError,
     r"model.safetensors: expert tensor model.layers.0.mlp.switch_mlp.gate_proj.weight has shape \[16, 32, 64\], "
     r"config.json makes it \[16, 48, 64\]"),
    (dict(hidden_size=128), CheckpointError, r"expert tensor .* has shape \[16, 32, 64\], config.json makes it \[16, 32, 128\]"),
])
def test_bad_input_is_named_before_any_weight_is_read(tmp_path: Path, qwen3_moe_src: Path, monkeypatch: pytest.MonkeyPatch,
                                                      edit: dict[str, Any], error: type, match: str) -> None:
    src = _copy(qwen3_moe_src, tmp_path)
    _edit_config(src, **edit)
    _no_weight_reads(monkeypatch)
    with pytest.raises(error, match=match):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_original_hf_checkpoint_is_sent_through_mlx_lm_first(tmp_path: Path, qwen3_moe_src: Path) -> None:
    src = _copy(qwen3_moe_src, tmp_path)
    w = _load(src / "model.safetensors")
    hf = {}
    for k, v in w.items():  # the HF layout: one tensor per expert, which mlx-lm's sanitize stacks
        if ".switch_mlp." in k:
            for e in range(v.shape[0]):
                hf[k.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
        else:
            hf[k] = v
    mx.save_safetensors(str(src / "model.safetensors"), hf)
    logs: list[str] = []
    report = convert(src, tmp_path / "out", log=logs.append)  # no longer an error: mlx-lm's conversion runs first
    assert report.source_layout == "hf"
    assert any("mlx-lm's sanitize changes model.layers.0.mlp.experts.0.down_proj.weight" in m for m in logs)
    convert(qwen3_moe_src, tmp_path / "direct")
    for f in ("experts/index.json", "experts/layer_000.bin", "model.safetensors"):  # the mlx-lm directory's records
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f
    # An mlx-lm directory that sanitize would still change is refused by the re-layout itself, naming them.
    from qnpipe.convert.family import plan_family
    from qnpipe.model.checkpoint import scan

    with pytest.raises(CheckpointError, match=r"not an mlx-lm model directory: mlx-lm's sanitize would change its "
                       r"expert tensors \(model.layers.0.mlp.switch_mlp.down_proj.weight"):
        plan_family(src, json.loads((src / "config.json").read_text()), scan(src))


def test_a_stray_tensor_and_transform_options_are_refused(tmp_path: Path, qwen3_moe_src: Path) -> None:
    src = _copy(qwen3_moe_src, tmp_path)
    with pytest.raises(ConfigError, match=r"--bits applies to qwen3_next sources and original Hugging Face checkpoints "
                       r"only; .* is a qwen3_moe model's mlx-lm directory"):
        convert(src, tmp_path / "out", bits=4)
    w = _load(src / "model.safetensors")
    w["model.layers.0.mlp.switch_mlp.extra_norm.weight"] = mx.ones((4,))  # under the switch's path, no linear's
    mx.save_safetensors(str(src / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=r"not those of the config's qwen3_moe model \(missing \[\], unexpected "
                       r"\['model.layers.0.mlp.switch_mlp.extra_norm.weight'\]\)"):
        convert(src, tmp_path / "out")


def test_a_converted_directory_is_never_converted_again(tmp_path: Path, qwen3_moe_src: Path) -> None:
    convert(qwen3_moe_src, tmp_path / "qn")
    with pytest.raises(CheckpointError, match="already a qnpipe model directory"):
        convert(tmp_path / "qn", tmp_path / "again")
