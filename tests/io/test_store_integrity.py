"""Issue 8 items 1 and 9: corrupt records caught on eager load; verify-store and the loader agree."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from deadline import deadline

from qnpipe.convert.verify import verify_store
from qnpipe.errors import StoreError
from qnpipe.io.store import read_index
from qnpipe.model.load import load_model


@pytest.fixture
def qn(tmp_path: Path, tiny_qn4: Path) -> Path:
    """A private copy of the converted tiny model, free to break."""
    d = tmp_path / "qn"
    shutil.copytree(tiny_qn4, d)
    return d


def _xor(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def test_flipped_bytes_at_random_records_are_caught_on_eager_load(qn: Path) -> None:
    root, index = read_index(qn)
    rng = random.Random(8)
    for _ in range(8):
        lf = rng.choice(index.layers)
        expert = rng.randrange(lf.num_experts)
        within = rng.randrange(lf.record_nbytes)
        mask = 1 << rng.randrange(8)
        path = root / lf.file
        offset = expert * lf.stride
        _xor(path, offset + within, mask)
        with pytest.raises(StoreError) as e:
            load_model(qn, verify=True)
        msg = str(e.value)
        assert "checksum mismatch" in msg
        assert f"layer {lf.layer} expert {expert} at offset {offset}" in msg, msg
        assert str(path) in msg
        _xor(path, offset + within, mask)  # restore
    load_model(qn, verify=True)  # intact again: loads


def test_random_store_bytes_caught_with_verify_trusted_without(qn: Path) -> None:
    root, index = read_index(qn)
    lf = index.layers[3]
    path = root / lf.file
    path.write_bytes(random.Random(1).randbytes(lf.file_nbytes))
    with pytest.raises(StoreError, match=rf"layer {lf.layer} expert 0 at offset 0"):
        load_model(qn, verify=True)
    load_model(qn, verify=False)  # verification off trusts the disk (docs/store-format.md)


def _edit_index(d: Path, edit) -> None:
    p = d / "experts" / "index.json"
    raw = json.loads(p.read_text())
    edit(raw)
    p.write_text(json.dumps(raw))


def _both_refuse(d: Path, match: str) -> None:
    with pytest.raises(StoreError, match=match):
        load_model(d)
    with pytest.raises(StoreError, match=match):
        verify_store(d)


def test_layer_missing_from_index_refused_by_both(qn: Path) -> None:
    _edit_index(qn, lambda raw: raw["layers"].pop(2))
    _both_refuse(qn, r"missing layer\(s\) \[2\]")


def test_tampered_shape_refused_by_both(qn: Path) -> None:
    def swap(raw: dict) -> None:
        t = raw["layers"][0]["tensors"][0]
        t["shape"] = list(reversed(t["shape"]))  # same byte count, wrong shape

    _edit_index(qn, swap)
    _both_refuse(qn, r"layer 0 .*tensor gate_proj.weight has shape")


def test_tampered_bits_refused_by_both(qn: Path) -> None:
    def bits(raw: dict) -> None:
        raw["layers"][1]["quant"]["up_proj"]["bits"] = 8

    _edit_index(qn, bits)
    _both_refuse(qn, r"layer 1 .*up_proj")


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_non_regular_layer_file_refused_without_blocking(qn: Path, kind: str) -> None:
    root, index = read_index(qn)
    path = root / index.layers[4].file
    path.unlink()
    os.mkfifo(path) if kind == "FIFO" else path.mkdir()
    with deadline(20):
        with pytest.raises(StoreError, match=rf"{path}: expert file of layer 4 is a {kind}"):
            load_model(qn)
        report = verify_store(qn)
    assert not report.ok
    assert any(f"is a {kind}" in m for m in report.file_errors)
