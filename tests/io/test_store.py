"""The expert store: validation at open, record access for the reader, verify-on-read and verify-store."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

from qnpipe.cli import main
from qnpipe.convert.verify import verify_store
from qnpipe.errors import StoreError
from qnpipe.io.store import ExpertStore, read_index
from qnpipe.io.store_format import ALIGN, TENSOR_ALIGN, StoreIndex
from qnpipe.model.args import model_id, read_config
from qnpipe.model.load import load_model


@pytest.fixture
def qn(tmp_path: Path, tiny_qn4: Path) -> Path:
    """A private copy of the converted tiny model, free to break."""
    d = tmp_path / "qn"
    shutil.copytree(tiny_qn4, d)
    return d


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_record_access_matches_the_layer_and_is_zero_copy(tiny_qn4: Path) -> None:
    with ExpertStore.open(tiny_qn4, expected_model_id=model_id(read_config(tiny_qn4))) as store:
        assert store.layers == tuple(range(8))
        layer = store.read_layer(5, verify=True)
        lf = store.layer_file(5)
        assert lf.record_nbytes <= lf.stride and lf.stride % ALIGN == 0
        assert all(t.offset % TENSOR_ALIGN == 0 for t in lf.tensors)
        assert [t.name for t in lf.tensors] == [f"{p}.{n}" for p in ("gate_proj", "up_proj", "down_proj")
                                                for n in ("weight", "scales", "biases")]
        for e in (0, 31, 63):
            path, offset, nbytes = store.record_location(5, e)
            assert path == tiny_qn4 / "experts" / "layer_005.bin" and offset == e * lf.stride and offset % ALIGN == 0
            assert nbytes == lf.record_nbytes
            buf = store.read_record(5, e, verify=True)
            with open(path, "rb") as f:
                f.seek(offset)
                assert f.read(nbytes) == buf
            views = store.record_tensors(5, buf)
            for name, v in views.items():
                assert np.shares_memory(v, np.frombuffer(buf, np.uint8)), name  # a view, not a copy
                assert np.array_equal(v, layer[name][e]), (e, name)
        rw = bytearray(store.read_record(5, 1))
        v = store.record_tensors(5, rw)["down_proj.weight"]
        v[0, 0] = 7  # views into a writable buffer write through
        off = next(t.offset for t in lf.tensors if t.name == "down_proj.weight")
        assert int.from_bytes(rw[off:off + 4], "little") == 7
        with pytest.raises(StoreError, match="expert 64 out of range"):
            store.record_location(5, 64)
        with pytest.raises(StoreError, match="no layer 9"):
            store.read_record(9, 0)
        with pytest.raises(ValueError, match="needs"):
            store.record_tensors(5, b"\0" * 100)


def test_truncated_expert_file_fails_at_open(qn: Path) -> None:
    f = qn / "experts" / "layer_004.bin"
    want = f.stat().st_size
    os.truncate(f, want - 4096)
    with pytest.raises(StoreError, match=rf"layer_004\.bin: truncated: {want - 4096} bytes, the index expects {want}"):
        ExpertStore.open(qn)
    with pytest.raises(StoreError, match=r"layer_004\.bin: truncated"):
        load_model(qn)
    with open(f, "ab") as fh:
        fh.write(b"\0" * 8192)
    with pytest.raises(StoreError, match="larger than the index says"):
        ExpertStore.open(qn / "experts")
    f.unlink()
    with pytest.raises(StoreError, match=r"layer_004\.bin: missing expert file of layer 4"):
        ExpertStore.open(qn)


def test_flipped_byte_found_by_verify_on_read_and_verify_store(qn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ExpertStore.open(qn) as store:
        _, offset, _ = store.record_location(2, 17)
        tensor = next(t for t in store.layer_file(2).tensors if t.name == "up_proj.scales")
    _flip(qn / "experts" / "layer_002.bin", offset + tensor.offset + 3)
    with ExpertStore.open(qn) as store:  # sizes are intact: open succeeds, reads without verify too
        store.read_record(2, 17)
        store.read_record(2, 16, verify=True)
        with pytest.raises(StoreError, match=rf"layer_002\.bin: checksum mismatch for layer 2 expert 17 at offset {offset}"):
            store.read_record(2, 17, verify=True)
        with pytest.raises(StoreError, match="layer 2 expert 17"):
            store.read_layer(2, verify=True)
    report = verify_store(qn)
    assert not report.ok and report.records_checked == 8 * 64
    [bad] = report.bad
    assert (bad.layer, bad.expert, bad.offset, bad.reason) == (2, 17, offset, "checksum mismatch")
    assert bad.file == str(qn / "experts" / "layer_002.bin")
    assert main(["verify-store", str(qn)]) == 1
    text = capsys.readouterr().out
    assert f"layer 2 expert 17: checksum mismatch ({qn / 'experts' / 'layer_002.bin'}, offset {offset}" in text
    assert main(["verify-store", str(qn / "experts"), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["bad"][0]["expert"] == 17 and rep["bad"][0]["offset"] == offset


def test_verify_store_ok_and_truncated(qn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify-store", str(qn), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["records_checked"] == 512 and rep["bad"] == [] and rep["bytes_per_s"] > 0
    f = qn / "experts" / "layer_007.bin"
    stride = read_index(qn)[1].layers[7].stride
    os.truncate(f, f.stat().st_size - 2 * stride)
    report = verify_store(qn)
    assert [(b.layer, b.expert, b.reason) for b in report.bad] == [(7, 62, "missing (file truncated)"),
                                                                     (7, 63, "missing (file truncated)")]
    assert "layer_007.bin: truncated" in report.file_errors[0]
    assert main(["verify-store", str(qn)]) == 1


def test_missing_index(qn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (qn / "experts" / "index.json").unlink()
    for call in (lambda: ExpertStore.open(qn), lambda: load_model(qn), lambda: verify_store(qn)):
        with pytest.raises(StoreError, match=r"experts/index\.json: missing expert store index"):
            call()
    assert main(["verify-store", str(qn)]) == 2
    assert "missing expert store index" in capsys.readouterr().err


def test_index_from_another_model_is_refused(qn: Path, tmp_path: Path) -> None:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    other = make_tiny(tmp_path / "other-hf", layout="hf", seed=1,
                      config_overrides={"num_experts": 16, "num_hidden_layers": 4})
    convert(other, tmp_path / "other-qn", mtp_bits=0)
    shutil.rmtree(qn / "experts")
    shutil.copytree(tmp_path / "other-qn" / "experts", qn / "experts")
    with pytest.raises(StoreError, match=r"experts/index\.json: expert store belongs to another model"):
        load_model(qn)
    with pytest.raises(StoreError, match="another model"):
        verify_store(qn)
    with pytest.raises(StoreError, match="another model"):
        ExpertStore.open(qn, expected_model_id=model_id(read_config(qn)))
    ExpertStore.open(qn).close()  # without an expected id the store itself is fine


def test_bad_index_contents(qn: Path) -> None:
    path = qn / "experts" / "index.json"
    good = json.loads(path.read_text())

    def expect(edit, pattern: str) -> None:
        doc = json.loads(json.dumps(good))
        edit(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(StoreError, match=pattern):
            ExpertStore.open(qn)

    expect(lambda d: d.update(version=3), r"store format version 3; this qnpipe reads version 1 or 2")
    expect(lambda d: d.update(format="other"), "format is 'other'")
    expect(lambda d: d["layers"][3].update(stride=1000), r"layer 3 .*stride 1000 must be a multiple of 4096")
    expect(lambda d: d["layers"][1].update(checksums=[0]), r"layer 1 .*1 checksums for 64 experts")
    expect(lambda d: d["layers"][0].update(file="../escape.bin"), "must be a plain name")
    expect(lambda d: d["layers"][0]["tensors"][0].update(offset=10**6), r"tensor gate_proj\.weight .* does not fit")
    expect(lambda d: d["layers"][2].pop("checksums"), r"invalid index .*checksums")
    path.write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        ExpertStore.open(qn)


def test_index_is_the_documented_struct_with_crc_per_record(tiny_qn4: Path) -> None:
    raw = (tiny_qn4 / "experts" / "index.json").read_bytes()
    index = msgspec.json.decode(raw, type=StoreIndex)
    assert index.model_id == model_id(read_config(tiny_qn4)) and len(index.model_id) == 64
    lf = index.layers[0]
    with open(tiny_qn4 / "experts" / lf.file, "rb") as f:
        data = f.read()
    assert len(data) == lf.file_nbytes == lf.num_experts * lf.stride
    for e in range(lf.num_experts):
        rec = data[e * lf.stride: e * lf.stride + lf.record_nbytes]
        assert zlib.crc32(rec) == lf.checksums[e]
        assert data[e * lf.stride + lf.record_nbytes: (e + 1) * lf.stride] == b"\0" * (lf.stride - lf.record_nbytes)
    assert {p: (q.bits, q.group_size, q.mode) for p, q in (lf.quant or {}).items()} == {
        p: (4, 64, "affine") for p in ("gate_proj", "up_proj", "down_proj")}


def test_expert_store_elsewhere_via_config(tmp_path: Path, tiny_qn4: Path) -> None:
    import qnpipe

    d = tmp_path / "model"
    shutil.copytree(tiny_qn4, d)
    elsewhere = tmp_path / "ssd" / "experts"
    elsewhere.parent.mkdir()
    (d / "experts").rename(elsewhere)
    toks = [5, 17, 300, 42, 9]
    with qnpipe.Engine(tiny_qn4) as ref:
        want = ref.logits(toks)
    with qnpipe.Engine(d, expert_dir=str(elsewhere)) as eng:  # config model.expert_dir (EXPERT_DIR)
        assert np.array_equal(eng.logits(toks), want)
    cfg = qnpipe.config.load(env={"EXPERT_DIR": str(elsewhere)})
    with qnpipe.Engine(d, cfg) as eng:
        assert np.array_equal(eng.logits(toks), want)
    with pytest.raises(StoreError, match="index"):
        qnpipe.Engine(d)
