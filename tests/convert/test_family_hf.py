"""`qnpipe convert` of an original Hugging Face checkpoint of another family: mlx-lm's own conversion first,
then the re-layout. The result is bit for bit `mlx_lm.convert` followed by `qnpipe convert` of its directory
(every tensor, record, the index and config.json), with the source's own tokenizer files; the temporary
directory is gone after success and failure; `--json` still prints one JSON object.

The tiny HF checkpoints are tiny random mlx-lm models written back in HF naming (the inverse of each
family's `sanitize`): qwen3_moe and mixtral one tensor per expert, gpt_oss its mxfp4 blocks and scales
with gate and up interleaved in `gate_up_proj`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from qnpipe.cli import main
from qnpipe.convert import convert
from qnpipe.convert.family_hf import mtp_tensors
from qnpipe.convert.tiny import TOKENIZER_DIR, TOKENIZER_FILES
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.io.outdir import TMP_TAG
from qnpipe.model.family import tiny


def _finish(d: Path, cfg: dict[str, Any], weights: dict[str, mx.array]) -> Path:
    d.mkdir(parents=True)
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, d / f)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return d


def hf_per_expert(d: Path, family: str, switch: str, names: dict[str, str], **cfg_extra: Any) -> Path:
    """A float32 tiny model whose stacked `<switch>.<linear>.weight` are written one tensor per expert
    (`experts.E.<names[linear]>.weight`), as qwen3_moe's and mixtral's sanitize expect them."""
    cfg = tiny.tiny_config(family)
    model = tiny.build_random(cfg, None)
    out: dict[str, mx.array] = {}
    for k, v in tree_flatten(model.parameters()):
        assert isinstance(v, mx.array)
        part = f".{switch}."
        if part in k:
            pre, lin = k.split(part)
            linear = lin.split(".")[0]
            for e in range(v.shape[0]):
                out[f"{pre}.experts.{e}.{names[linear]}.weight"] = v[e]
        else:
            out[k] = v
    return _finish(d, {**cfg, **cfg_extra}, out)


def hf_gpt_oss(d: Path) -> Path:
    """A tiny gpt_oss in its Hugging Face form: experts mxfp4 (`*_blocks` uint8, `*_scales`), gate and up
    interleaved row by row in `gate_up_proj`, the rest float32; `quantization_config` mxfp4."""
    cfg = tiny.tiny_config("gpt_oss")
    model = tiny.build_random(cfg, None)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    w = dict(tree_flatten(model.parameters()))
    out: dict[str, mx.array] = {}

    def interleave(a: mx.array, b: mx.array) -> mx.array:  # rows a0, b0, a1, b1, ... along axis 1 (the outputs)
        return mx.stack([a, b], axis=2).reshape(a.shape[0], a.shape[1] * 2, *a.shape[2:])

    def blocks(a: mx.array) -> mx.array:  # uint32 [E, O, H/8] -> uint8 [E, O, H/32, 16]
        return a.view(mx.uint8).reshape(*a.shape[:-1], -1, 16)

    for k, v in w.items():
        if ".mlp.experts." not in k:
            out[k] = v
            continue
        pre, rest = k.split(".mlp.experts.")
        lin, param = rest.split(".")
        base = f"{pre}.mlp.experts."
        if lin == "down_proj":
            out[base + {"weight": "down_proj_blocks", "scales": "down_proj_scales", "bias": "down_proj_bias"}[param]] = \
                blocks(v) if param == "weight" else v
        elif lin == "gate_proj":
            up = w[f"{base}up_proj.{param}"]
            if param == "bias":
                out[base + "gate_up_proj_bias"] = interleave(v, up)
            else:
                g, u = (blocks(v), blocks(up)) if param == "weight" else (v, up)
                out[base + f"gate_up_proj_{'blocks' if param == 'weight' else 'scales'}"] = interleave(g, u)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    return _finish(d, cfg, out)


def make_src(d: Path, family: str) -> Path:
    if family == "qwen3_moe":  # torch_dtype float32 keeps the float source float (mlx-lm casts to it)
        return hf_per_expert(d, "qwen3_moe", "switch_mlp", {n: n for n in ("gate_proj", "up_proj", "down_proj")},
                             torch_dtype="float32")
    if family == "mixtral":  # torch_dtype bfloat16: mlx-lm casts the float32 source
        return hf_per_expert(d, "mixtral", "switch_mlp", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
                             torch_dtype="bfloat16")
    return hf_gpt_oss(d)


def by_hand(src: Path, d: Path, bits: int | None) -> Path:
    """`mlx_lm.convert --hf-path src --mlx-path d [-q --q-bits bits]`, then `qnpipe convert d`."""
    import contextlib
    import io

    from mlx_lm.convert import convert as mlx_lm_convert

    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm_convert(str(src), str(d / "mlx"), quantize=bits is not None, q_bits=bits)
    convert(d / "mlx", d / "qn")
    return d / "qn"


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


CASES = [("qwen3_moe", None), ("qwen3_moe", 4), ("mixtral", None), ("gpt_oss", None), ("gpt_oss", 4)]


@pytest.mark.parametrize("family, bits", CASES, ids=[f"{f}-{b or 'float'}" for f, b in CASES])
def test_hf_checkpoint_equals_mlx_lm_convert_then_qnpipe_convert(tmp_path: Path, family: str, bits: int | None) -> None:
    src = make_src(tmp_path / "src", family)
    logs: list[str] = []
    report = convert(src, tmp_path / "out" / "qn", bits=bits, log=logs.append)
    got = _files(tmp_path / "out" / "qn")
    want = _files(by_hand(src, tmp_path / "hand", bits))
    # transformers' re-save of the tokenizer (mlx_lm.convert's) differs from the source's files: those are copied
    tok = {f for f in {*got, *want}
           if f.startswith(("tokenizer", "chat_template")) or f in ("generation_config.json", "special_tokens_map.json")}
    assert {f: v for f, v in got.items() if f not in tok} == {f: v for f, v in want.items() if f not in tok}
    for f in (*TOKENIZER_FILES, "generation_config.json"):  # the source's own files, not transformers' re-save
        assert got[f] == (src / f).read_bytes(), f
    assert {f for f in got if f in tok} == {*TOKENIZER_FILES, "generation_config.json"}
    assert report.source_layout == "hf" and report.moe_layers >= 1
    assert report.dtype == ("bfloat16" if family == "mixtral" else "float32")
    assert (report.quantization or {}).get("mode") == ("mxfp4" if family == "gpt_oss" else "affine" if bits else None)
    assert any("converting it with mlx-lm" in m for m in logs)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["qn"]  # the temporary directory is gone


def test_json_prints_one_object_and_mlx_lm_prints_nothing_to_stdout(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    src = make_src(tmp_path / "src", "qwen3_moe")
    assert main(["convert", str(src), "--out", str(tmp_path / "qn"), "--bits", "4", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["source_layout"] == "hf"


def test_bad_options_and_a_failing_conversion_leave_nothing(tmp_path: Path) -> None:
    src = make_src(tmp_path / "src", "qwen3_moe")
    with pytest.raises(ConfigError, match=r"--mode mxfp4 is 4-bit with group size 32 \(got --bits 8"):
        convert(src, tmp_path / "out" / "qn", bits=8, mode="mxfp4")
    with pytest.raises(ConfigError, match=r"--mtp-from applies to qwen3_next sources only"):
        convert(src, tmp_path / "out" / "qn", mtp_from=src)
    w = mx.load(str(src / "model.safetensors"))
    assert isinstance(w, dict)
    w["mtp.fc.weight"] = mx.zeros((4, 4))  # qwen3_moe's sanitize keeps it, so mlx-lm's strict load refuses it
    mx.save_safetensors(str(src / "model.safetensors"), w)
    logs: list[str] = []
    with pytest.raises(CheckpointError, match=r"src: mlx-lm cannot load it as a Hugging Face checkpoint \(ValueError"):
        convert(src, tmp_path / "out" / "qn", log=logs.append)
    assert any("holds 1 MTP tensors (mtp.fc.weight, ...)" in m and "MTP runs on Qwen3-Next only" in m for m in logs)
    assert not [p for p in (tmp_path / "out").iterdir() if TMP_TAG in p.name or p.name == "qn"]


def test_mtp_tensors_are_mtp_prefixes_and_layers_past_the_last() -> None:
    infos: dict[str, Any] = dict.fromkeys(["model.layers.2.x", "model.layers.3.x", "mtp.a", "model.mtp.b", "lm_head"])
    assert mtp_tensors({"num_hidden_layers": 3}, infos) == ["model.layers.3.x", "mtp.a", "model.mtp.b"]
    assert mtp_tensors({"text_config": {"num_hidden_layers": 4}}, infos) == ["mtp.a", "model.mtp.b"]


def test_ctrl_c_during_mlx_lm_conversion_leaves_nothing_and_a_killed_ones_dir_is_removed_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_src(tmp_path / "src", "qwen3_moe")
    seen: list[Path] = []

    def interrupted(s: Path, dst: Path, **kw: Any) -> None:
        dst.mkdir()
        (dst / "model.safetensors").write_bytes(b"half")
        seen.append(dst.parent)
        raise KeyboardInterrupt

    monkeypatch.setattr("qnpipe.convert.family_hf.mlx_lm_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out" / "qn")
    assert seen and seen[0].parent == tmp_path / "out" and not seen[0].exists()
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    left = tmp_path / "out" / f".qn{TMP_TAG}1-deadbeef-mlx-lm"  # what a SIGKILL leaves (its lock no longer held)
    (left / "mlx").mkdir(parents=True)
    (left / ".lock").touch()
    logs: list[str] = []
    convert(src, tmp_path / "out" / "qn", log=logs.append)
    assert not left.exists() and any("left by an interrupted run" in m for m in logs)


def test_a_hub_id_of_another_familys_hf_checkpoint_goes_through_mlx_lm_too(tmp_path: Path) -> None:
    from tests.cli_harness import run_cli
    from tests.convert.test_hub import REPO, _env, _hub_cache

    src = make_src(tmp_path / "src", "gpt_oss")
    r = run_cli(["convert", REPO, "--out", tmp_path / "qn", "--json"], env=_env(_hub_cache(tmp_path / "hub", src)),
                timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.decode().count("\n") == 1 and json.loads(r.stdout)["source_layout"] == "hf"
    convert(src, tmp_path / "ref")
    assert _files(tmp_path / "qn") == _files(tmp_path / "ref")
