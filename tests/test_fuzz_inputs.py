"""Fuzzing the files qnpipe reads (issue 8): only QnpipeError subclasses come out, never a hang.

Covered: a safetensors header, a store's index.json, a layer file, a TOML config file.
(Heat files do not exist yet; nothing to fuzz there.) Every case runs under an alarm.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
from deadline import deadline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qnpipe import config
from qnpipe.config import NotImplementedConfigWarning
from qnpipe.convert.verify import verify_store
from qnpipe.errors import QnpipeError
from qnpipe.io.store import ExpertStore, read_index
from qnpipe.model.checkpoint import read_header
from tests.profiles import examples

# fewer: each example writes and reads a file
FUZZ = settings(examples(60), database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _only_ours(fn) -> None:
    """Run fn; any exception must be a QnpipeError (a TimeoutError from `within` fails the test)."""
    with deadline(10), warnings.catch_warnings():
        # "has no effect yet" warns once per process: the same input must act the same every time.
        warnings.simplefilter("ignore", NotImplementedConfigWarning)
        try:
            fn()
        except QnpipeError:
            pass


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        if b:
            b[pos % len(b)] = val
    if cut is not None and b:
        del b[cut % len(b):]
    return bytes(b)


edits_st = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=8)
cut_st = st.none() | st.integers(0, 2**20)


# ---------------------------------------------------------------- safetensors header

_GOOD_HEADER = json.dumps({
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
}).encode()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


def _st_file(tmp: Path, header: bytes, data: bytes = b"\0" * 32, n: int | None = None) -> Path:
    p = tmp / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)
    return p


@FUZZ
@given(header=st.binary(max_size=300), n=st.none() | st.integers(0, 2**64 - 1))
def test_random_safetensors_header(tmp_path: Path, header: bytes, n: int | None) -> None:
    p = _st_file(tmp_path, header, n=n)
    _only_ours(lambda: read_header(p))


@FUZZ
@given(edits=edits_st, cut=cut_st)
def test_mutated_safetensors_header(tmp_path: Path, edits: list[tuple[int, int]], cut: int | None) -> None:
    p = _st_file(tmp_path, _mutate(_GOOD_HEADER, edits, cut))
    _only_ours(lambda: read_header(p))


@FUZZ
@given(entry=json_values, shape=json_values, offsets=json_values, dtype=json_values)
def test_wrongly_typed_safetensors_entries(tmp_path: Path, entry, shape, offsets, dtype) -> None:
    header = {"x": {"dtype": dtype, "shape": shape, "data_offsets": offsets}, "y": entry}
    p = _st_file(tmp_path, json.dumps(header).encode())
    _only_ours(lambda: read_header(p))


# ---------------------------------------------------------------- store index.json and layer files

@pytest.fixture(scope="module")
def store_master(tmp_path_factory: pytest.TempPathFactory, tiny_qn4: Path) -> Path:
    d = tmp_path_factory.mktemp("fuzz") / "qn"
    shutil.copytree(tiny_qn4, d)
    return d


@pytest.fixture
def store(tmp_path: Path, store_master: Path) -> Path:
    d = tmp_path / "qn"
    shutil.copytree(store_master, d)
    return d


def _open_and_read(d: Path) -> None:
    with ExpertStore.open(d) as s:
        for layer in s.layers[:2]:
            s.read_layer(layer, verify=True)
            s.read_record(layer, 0, verify=True)


@FUZZ
@given(edits=edits_st, cut=cut_st)
def test_mutated_index_json(store: Path, edits: list[tuple[int, int]], cut: int | None) -> None:
    p = store / "experts" / "index.json"
    good = p.read_bytes()
    p.write_bytes(_mutate(good, edits, cut))
    _only_ours(lambda: _open_and_read(store))
    _only_ours(lambda: verify_store(store))
    p.write_bytes(good)


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_index_json(store: Path, data: bytes) -> None:
    (store / "experts" / "index.json").write_bytes(data)
    _only_ours(lambda: read_index(store))
    _only_ours(lambda: verify_store(store))


@FUZZ
@given(key=st.sampled_from(["num_experts", "stride", "record_nbytes", "file_nbytes", "tensors", "quant",
                            "checksums", "file", "layer"]),
       value=json_values, top=st.sampled_from([None, "align", "model_id", "checksum", "layers"]))
def test_wrongly_typed_index_fields(store: Path, key: str, value, top: str | None) -> None:
    p = store / "experts" / "index.json"
    good = p.read_bytes()
    raw = json.loads(good)
    if top is None:
        raw["layers"][0][key] = value
    else:
        raw[top] = value
    p.write_text(json.dumps(raw))
    _only_ours(lambda: _open_and_read(store))
    _only_ours(lambda: verify_store(store))
    p.write_bytes(good)


@FUZZ
@given(data=st.binary(max_size=64) | st.none(), edits=edits_st, cut=cut_st)
def test_random_or_mutated_layer_file(store: Path, data: bytes | None, edits, cut) -> None:
    p = store / "experts" / "layer_000.bin"
    good = p.read_bytes()
    p.write_bytes(_mutate(good, edits, cut) if data is None else data * (len(good) // max(1, len(data))))
    _only_ours(lambda: _open_and_read(store))
    with deadline(10):
        report = verify_store(store)
    _, index = read_index(store)
    lf = index.layers[0]
    now = p.read_bytes()
    intact = len(now) == len(good) and all(  # the padding after each record is not checksummed
        now[e * lf.stride:e * lf.stride + lf.record_nbytes] == good[e * lf.stride:e * lf.stride + lf.record_nbytes]
        for e in range(lf.num_experts))
    assert report.ok == intact
    p.write_bytes(good)


# ---------------------------------------------------------------- TOML config file

_GOOD_TOML = b"""\
[pool]
expert_slots = 32

[read]
verify_crc32 = true

[forward]
prefill_chunk_tokens = 64

[seed]
MTP_DEPTH = 2
"""

toml_scalars = st.one_of(
    st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=10).map(json.dumps),
    st.sampled_from(["true", "false", "1979-05-27T07:32:00Z", "[1, 2]", "{a = 1}", "inf", "nan", '""', "[]"]),
)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_toml_bytes(tmp_path: Path, data: bytes) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(data)
    _only_ours(lambda: config.load(p, env={}))


@FUZZ
@given(edits=edits_st, cut=cut_st)
def test_mutated_toml(tmp_path: Path, edits: list[tuple[int, int]], cut: int | None) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(_mutate(_GOOD_TOML, edits, cut))
    _only_ours(lambda: config.load(p, env={}))


@FUZZ
@given(field=st.sampled_from(sorted(s.path for s in config.field_specs())), value=toml_scalars)
def test_any_value_for_any_toml_field(tmp_path: Path, field: str, value: str) -> None:
    section, name = field.split(".")
    p = tmp_path / "c.toml"
    p.write_text(f"[{section}]\n{name} = {value}\n")
    _only_ours(lambda: config.load(p, env={}))


@FUZZ
@given(data=st.binary(max_size=400), edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                     max_size=8), cut=st.none() | st.integers(0, 10_000))
def test_heat_file_bytes_give_counts_or_one_warning(tmp_path: Path, data: bytes, edits: list[tuple[int, int]],
                                                    cut: int | None) -> None:
    """Random bytes, or a valid heat file mutated, as the autopin heat file: counts or a warning, never an error."""
    from qnpipe.io.heat_file import HeatFileWarning, encode_heat, load_heat

    good = encode_heat("m1", {0: {1: 5, 2: 3}, 3: {7: 1}})
    for raw in (data, _mutate(good, edits, cut)):
        p = tmp_path / "pool_usage.json"
        p.write_bytes(raw)
        with deadline(10), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            counts = load_heat(p, "m1")
        assert isinstance(counts, dict)
        if seen:
            assert len(seen) == 1 and issubclass(seen[0].category, HeatFileWarning) and str(p) in str(seen[0].message)
            assert counts == {}
