"""`qnpipe convert`: round trips from both layouts, mlx-lm-identical quantization, atomicity, bad input."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import qnpipe
import qnpipe.convert.build as cv
from qnpipe.cli import main
from qnpipe.errors import CheckpointError, ConfigError, OutputError, QnpipeError
from qnpipe.io.outdir import TMP_TAG
from qnpipe.io.store import ExpertStore, as_mx
from qnpipe.model.checkpoint import Layout, load_safetensors
from qnpipe.model.load import load_model

PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3, 64, 128]


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _logits(model_dir: Path) -> np.ndarray:
    with qnpipe.Engine(model_dir, prefill_chunk_tokens=0) as eng:
        return eng.logits(PROMPT)


def _weights(d: Path, pattern: str = "model*.safetensors") -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(d.glob(pattern)):
        out.update(load_safetensors(f))
    return out


def _leftovers(parent: Path) -> list[Path]:
    return sorted(parent.glob(f"*{TMP_TAG}*"))


def _assert_same_as_mlx(qn: Path, ref: Path) -> None:
    """Every non-expert tensor, every expert record and the quantization config equal `ref`'s, bit for bit."""
    want = _weights(ref)
    got = _weights(qn)
    assert set(got) == {k for k in want if ".switch_mlp." not in k}
    for k, v in got.items():
        assert v.dtype == want[k].dtype and np.array_equal(_bits(v), _bits(want[k])), k
    with ExpertStore.open(qn) as store:
        for layer in store.layers:
            for name, arr in store.read_layer(layer, verify=True).items():
                ref_arr = _bits(want[f"model.layers.{layer}.mlp.switch_mlp.{name}"])
                assert arr.dtype == ref_arr.dtype and np.array_equal(arr, ref_arr), (layer, name)
    cfg, ref_cfg = (json.loads((d / "config.json").read_text()) for d in (qn, ref))
    assert cfg["quantization"] == ref_cfg["quantization"]
    assert cfg["quantization_config"] == ref_cfg["quantization"]


# --------------------------------------------------------------------------- round trips


def test_hf_float_round_trip_from_shards(tmp_path: Path, tiny_hf: Path) -> None:
    from qnpipe.convert.tiny import make_tiny

    src = make_tiny(tmp_path / "hf3", layout="hf", seed=0, shards=3)  # same weights as tiny_hf, 3 shards
    out = tmp_path / "qn"
    report = cv.convert(src, out, mtp_bits=0, row_block_bytes=20_000)  # large matrices go through in row blocks
    assert report.source_layout == "hf" and report.quantization is None and report.mtp
    hf = load_model(src)
    with ExpertStore.open(out) as store:
        for layer in store.layers:
            lf = store.layer_file(layer)
            assert lf.stride % 4096 == 0 and lf.file_nbytes == lf.num_experts * lf.stride
            for e in (0, 13, lf.num_experts - 1):
                buf = store.read_record(layer, e, verify=True)
                for name, view in store.record_tensors(layer, buf).items():
                    proj = getattr(hf.experts.layers[layer], name.split(".")[0])
                    assert np.array_equal(view, np.array(proj.weight[e])), (layer, e, name)
    # the MTP head, float, stays as in the HF shards (names, zero-centred norms, values)
    mtp = load_safetensors(out / "mtp.safetensors")
    assert set(mtp) == set(hf.mtp_weights)
    assert all(np.array_equal(np.array(mtp[k]), np.array(v)) for k, v in hf.mtp_weights.items())
    loaded = load_model(out)
    assert loaded.layout is Layout.QNPIPE and set(loaded.mtp_weights) == set(hf.mtp_weights)
    assert np.array_equal(_logits(out), _logits(tiny_hf))


@pytest.mark.parametrize("bits", [4, 8])
def test_hf_quantized_equals_mlx_lm_convert(tmp_path: Path, tiny_hf: Path, bits: int, request) -> None:
    ref = request.getfixturevalue(f"tiny_mlx{bits}")  # mlx_lm.convert -q --q-bits bits of the same source
    # At 4 bits: row blocks quantize exactly like the whole matrix; experts go in several chunks per layer.
    row_block, chunk = (20_000, 100_000) if bits == 4 else (cv.ROW_BLOCK_BYTES, cv.CHUNK_BYTES)
    out = tmp_path / "qn"
    report = cv.convert(tiny_hf, out, bits=bits, dtype="bfloat16", row_block_bytes=row_block, chunk_bytes=chunk)
    assert report.quantization == {"bits": bits, "group_size": 64, "mode": "affine"}
    _assert_same_as_mlx(out, ref)
    # the MTP head is quantized the same way at --mtp-bits (default 4), router and shared gate at 8
    mtp = load_safetensors(out / "mtp.safetensors")
    src = load_safetensors(tiny_hf / "model.safetensors")
    fc = mx.quantize(src["mtp.fc.weight"].astype(mx.bfloat16), 64, 4)
    assert all(np.array_equal(_bits(a), _bits(mtp[f"mtp.fc.{n}"])) for a, n in zip(fc, ("weight", "scales", "biases"), strict=True))
    assert mtp["mtp.layers.0.mlp.gate.weight"].shape == (64, 128 * 8 // 32)
    assert np.array_equal(_bits(mtp["mtp.norm.weight"]), _bits(src["mtp.norm.weight"].astype(mx.bfloat16)))
    section = json.loads((out / "config.json").read_text())["qnpipe"]
    assert section["mtp"]["quantization"]["bits"] == 4
    assert section["mtp"]["quantization"]["mtp.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert np.array_equal(_logits(out), _logits(ref))


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_source_round_trip_is_bit_identical(tmp_path: Path, tiny_hf: Path, bits: int, request) -> None:
    src = request.getfixturevalue(f"tiny_mlx{bits}")
    out = tmp_path / "qn"
    report = cv.convert(src, out, mtp_from=tiny_hf, max_shard_bytes=300_000)  # also sharded non-expert weights
    assert report.source_layout == "mlx" and report.mtp and report.dtype == "bfloat16"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    _assert_same_as_mlx(out, src)
    assert np.array_equal(_logits(out), _logits(src))


def test_mlx_source_without_mtp_warns(tmp_path: Path, tiny_mlx4: Path) -> None:
    messages: list[str] = []
    report = cv.convert(tiny_mlx4, tmp_path / "qn", log=messages.append)
    assert not report.mtp and not (tmp_path / "qn" / "mtp.safetensors").exists()
    assert any("no MTP weights" in m and "--mtp-from" in m for m in messages)
    assert json.loads((tmp_path / "qn" / "config.json").read_text())["qnpipe"]["mtp"] is None


def test_cli_convert_json_and_config_section(tmp_path: Path, tiny_mlx4: Path, tiny_hf: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qn"
    assert main(["convert", str(tiny_mlx4), "--out", str(out), "--mtp-from", str(tiny_hf), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["out"] == str(out) and rep["moe_layers"] == 8 and rep["num_experts"] == 64
    assert rep["bytes_written"] > rep["expert_bytes"] > 0 and rep["peak_rss_bytes"] > 0
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["qnpipe"]
    assert q["format"] == cv.MODEL_FORMAT and q["version"] == cv.MODEL_VERSION
    assert q["experts"]["stride"] % 4096 == 0 and q["experts"]["record"][0]["name"] == "gate_proj.weight"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not _leftovers(tmp_path)


# --------------------------------------------------------------------------- refusals and bad input


def test_refuses_existing_dir_without_force(tmp_path: Path, tiny_mlx4: Path) -> None:
    out = tmp_path / "qn"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        cv.convert(tiny_mlx4, out)
    with pytest.raises(OutputError, match="not a qnpipe output"):  # --force replaces only what qnpipe wrote
        cv.convert(tiny_mlx4, out, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    cv.convert(tiny_mlx4, out)
    (out / "stale.txt").write_text("from the first convert")
    cv.convert(tiny_mlx4, out, force=True)
    assert not (out / "stale.txt").exists() and (out / "experts" / "index.json").is_file()
    assert not _leftovers(tmp_path)


def test_source_of_neither_layout(tmp_path: Path, tiny_hf: Path) -> None:
    from safetensors.numpy import save_file

    src = tmp_path / "odd"
    src.mkdir()
    shutil.copy(tiny_hf / "config.json", src)
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"odd: neither an original Hugging Face .* nor an mlx-lm"):
        cv.convert(src, tmp_path / "qn")
    with pytest.raises(CheckpointError, match=r"empty/config\.json: not found"):
        (tmp_path / "empty").mkdir()
        cv.convert(tmp_path / "empty", tmp_path / "qn")
    assert not (tmp_path / "qn").exists() and not _leftovers(tmp_path)


def test_bad_options_and_sources(tmp_path: Path, tiny_mlx4: Path, tiny_qn4: Path, tiny_hf: Path) -> None:
    with pytest.raises(ConfigError, match="already quantized"):
        cv.convert(tiny_mlx4, tmp_path / "a", bits=8)
    with pytest.raises(CheckpointError, match="already a qnpipe model directory"):
        cv.convert(tiny_qn4, tmp_path / "b")
    with pytest.raises(ConfigError, match="--group-size"):
        cv.convert(tiny_hf, tmp_path / "c", bits=4, group_size=48)
    with pytest.raises(ConfigError, match="must not be SRC"):
        cv.convert(tiny_hf, tiny_hf.parent, force=True)
    broken = tmp_path / "hf"
    shutil.copytree(tiny_hf, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 32}))
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight has shape \[64, 128\], expected \[32, 128\]"):
        cv.convert(broken, tmp_path / "d")
    with pytest.raises(CheckpointError, match=r"hf/config\.json: --mtp-from is a checkpoint of another model"):
        cv.convert(tiny_mlx4, tmp_path / "e", mtp_from=broken)
    assert not any((tmp_path / n).exists() for n in "abcde") and not _leftovers(tmp_path)


def test_insufficient_disk_space(tmp_path: Path, tiny_mlx4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 12345, 12345))
    with pytest.raises(QnpipeError, match=r"needs \d+ bytes \(\d+\.\d\d MiB\), 12345 bytes \(12\.06 KiB\) are available"):
        cv.convert(tiny_mlx4, tmp_path / "qn")
    assert not (tmp_path / "qn").exists() and not _leftovers(tmp_path)


def test_failure_midway_leaves_nothing(tmp_path: Path, tiny_mlx4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = cv._expert_chunk

    def failing(*a, **k):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device (injected)")
        return real(*a, **k)

    monkeypatch.setattr(cv, "_expert_chunk", failing)
    with pytest.raises(OutputError, match=r"qn: No space left on device \(injected\)"):  # the output, not a temp name
        cv.convert(tiny_mlx4, tmp_path / "qn")
    assert calls == 3
    assert not (tmp_path / "qn").exists() and not _leftovers(tmp_path)


_SLOW_CONVERT = """
import sys, time
import qnpipe.convert.build as cv
from qnpipe.io.outdir import TMP_TAG
real = cv._expert_chunk
def slow(*a, **k):
    time.sleep(0.25)
    return real(*a, **k)
cv._expert_chunk = slow
from qnpipe.cli import main
sys.exit(main(["convert", sys.argv[1], "--out", sys.argv[2], "-q"]))
"""


def _start_and_signal(src: Path, out: Path, sig: int) -> int:
    """Run a slowed-down convert in a subprocess; send `sig` once it has written an expert layer."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, str(src), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(out.parent.glob(f".{out.name}{TMP_TAG}*/model/experts/layer_001.bin")):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "convert never started writing experts"
            time.sleep(0.02)
        proc.send_signal(sig)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_removes_everything(tmp_path: Path, tiny_mlx4: Path, sig: int) -> None:
    out = tmp_path / "qn"
    rc = _start_and_signal(tiny_mlx4, out, sig)
    assert rc == 128 + sig
    assert not out.exists() and not _leftovers(tmp_path)


def test_sigkill_leaves_only_the_temp_dir_and_the_next_convert_removes_it(tmp_path: Path, tiny_mlx4: Path) -> None:
    out = tmp_path / "qn"
    assert _start_and_signal(tiny_mlx4, out, signal.SIGKILL) == -signal.SIGKILL
    assert not out.exists()
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].name.startswith(".qn" + TMP_TAG)
    assert sorted(p.name for p in tmp_path.iterdir()) == [left[0].name]
    messages: list[str] = []
    cv.convert(tiny_mlx4, out, log=messages.append)
    assert any("interrupted run" in m for m in messages)
    assert not _leftovers(tmp_path) and (out / "experts" / "index.json").is_file()
    with ExpertStore.open(out) as store:
        buf = store.read_record(3, 7, verify=True)
        w = as_mx(store.record_tensors(3, buf)["up_proj.weight"], "uint32")
        assert np.array_equal(np.array(w), np.array(load_safetensors(tiny_mlx4 / "model.safetensors")[
            "model.layers.3.mlp.switch_mlp.up_proj.weight"][7]))


@pytest.mark.parametrize("cmd", ["convert", "verify-store"])
def test_help_has_description_and_examples(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: qnpipe {cmd}" in out and "examples:" in out and "--json" in out
