"""Fuzzing the importers' sources: a mutated or cut source raises TraceImportError (or imports), nothing else.

The `.pt` fuzzers write captures whose tensor metadata (storage offsets, sizes, strides, announced
element counts), layout fields, pickle bytes and zip structure (declared sizes, compression
methods, bytes) are drawn at random, and import each in a forked child under an address-space
limit: a segfault, a hang, a MemoryError or any exception but TraceImportError fails the test.
"""

from __future__ import annotations

import faulthandler
import gzip
import math
import os
import resource
import signal
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from deadline import deadline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pt_craft import META, Tensor, capture_tensors, pickled
from real_traces import MARIO, WEIRAN

from qnpipe import trace
from qnpipe.errors import TraceImportError
from qnpipe.trace.importers import import_log
from tests.profiles import examples

# fewer: each example writes and imports a file
FUZZ = settings(examples(60), database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
edits_st = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=8)
cut_st = st.none() | st.integers(0, 2**20)


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    if cut is not None:
        del b[cut % len(b):]
    return bytes(b)


def _lines(path: Path, keep: slice) -> bytes:
    return b"".join(gzip.decompress(path.read_bytes()).splitlines(keepends=True)[keep])


SOURCES = {
    # the prefill and first decode steps of Mixtral's raw log
    "mixtral-jsonl": _lines(MARIO / "routing_raw.jsonl.gz", slice(0, 300)),
    # the meta line, then the 65-row warm-up pass (after the profiling passes) and three 25-row passes
    "vllm-jsonl": _lines(WEIRAN / "moe_layer0.jsonl.gz", slice(0, 1)) + _lines(WEIRAN / "moe_layer0.jsonl.gz",
                                                                            slice(8449, 8449 + 65 + 1406 + 75)),
}


def _only_ours(fmt: str, src: Path, out: Path) -> None:
    with deadline(10):
        try:
            import_log(fmt, src, out)
        except TraceImportError:
            pass


@pytest.mark.parametrize("fmt", sorted(SOURCES))
@FUZZ
@given(edits=edits_st, cut=cut_st, gz=st.booleans())
def test_a_mutated_jsonl_source_fails_only_with_an_import_error(fmt: str, edits: list[tuple[int, int]],
                                                                cut: int | None, gz: bool, tmp_path: Path) -> None:
    data = _mutate(SOURCES[fmt], edits, cut)
    src = tmp_path / ("src.jsonl.gz" if gz else "src.jsonl")
    src.write_bytes(_mutate(gzip.compress(data), edits[:2], None) if gz else data)
    _only_ours(fmt, src, tmp_path / "out.qtrace")


@FUZZ
@given(edits=edits_st, cut=cut_st)
def test_a_mutated_pt_file_fails_only_with_an_import_error(flame_dir: Path, edits: list[tuple[int, int]],
                                                           cut: int | None, tmp_path: Path) -> None:
    good = next((flame_dir / "Decoder_Batch_0-64" / "1st" / "Layer_2").glob("*.pt")).read_bytes()
    src = tmp_path / "x.pt"
    src.write_bytes(_mutate(good, edits, cut))
    _only_ours("flame-pt", src, tmp_path / "out.qtrace")


# --- .pt files: crafted metadata and zip structure, imported in a child under a memory limit ---

HEADROOM = 768 << 20  # address space the child may add to what it already maps: far below a runaway allocation


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _in_child(fn: Callable[[], Any], seconds: int = 20) -> str | None:
    """None when `fn()` returns or raises TraceImportError in a forked child under RLIMIT_AS; else what happened."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        msg = b"?"
        try:
            os.close(r)
            faulthandler.disable()  # a crash is reported by its signal, not by a dump of pytest's stack
            limit = _vm_size() + HEADROOM
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.alarm(seconds)  # SIGALRM's default action kills a hung child
            try:
                fn()
                msg = b""
            except TraceImportError:
                msg = b""
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
                msg = f"{type(e).__name__}: {e}"[:1000].encode(errors="replace") or b"?"
            os.write(w, msg)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return out.decode(errors="replace") or None


EXTREME = st.sampled_from([-1, -(2**31), 2**31, 2**32, 2**62, 2**63, 2**64, 4 * 10**8, -(2**63), 10**30])
OFFSET = st.integers(-100, 100) | EXTREME
SIZE = st.integers(0, 20) | EXTREME
STRIDE = st.integers(-8, 8) | EXTREME
TENSOR_EDIT = st.fixed_dictionaries({}, optional={
    "offset": OFFSET, "size": st.lists(SIZE, max_size=3), "stride": st.lists(STRIDE, max_size=3),
    "numel": st.integers(-8, 120) | EXTREME})
META_EDIT = st.dictionaries(st.sampled_from(["layer", "token_position", "num_sequences", "sequence_length"]),
                            st.none() | st.integers(-2, 10) | EXTREME, max_size=2)


def _edit_tensors(edits: dict[str, dict[str, Any]]) -> dict[str, Tensor]:
    """The capture's tensors with `edits`; a size or stride list shorter than the tensor's replaces its first dims."""
    out = {}
    for k, t in capture_tensors(8).items():
        e = dict(edits.get(k, {}))
        for f in ("size", "stride"):
            if f in e:
                e[f] = tuple(e[f]) + getattr(t, f)[len(e[f]):]
        out[k] = t._replace(**e)
    return out


def _reference(t: Tensor) -> np.ndarray | None:
    """What torch reads for `t`, by index arithmetic; None when `t` reaches outside its data (torch would refuse)."""
    data = t.data[:t.numel] if 0 <= t.numel <= t.data.size else None
    if data is None or t.offset < 0 or len(t.size) != len(t.stride) or min(t.size + t.stride, default=0) < 0:
        return None
    n = math.prod(t.size)
    if n and t.offset + sum((d - 1) * s for d, s in zip(t.size, t.stride, strict=True)) >= data.size:
        return None
    if n > 1 << 20:
        return None  # valid for torch, but not something the reference will spell out
    idx = np.full(t.size, t.offset, dtype=object)
    for axis, (d, s) in enumerate(zip(t.size, t.stride, strict=True)):
        shape = [1] * len(t.size)
        shape[axis] = d
        idx = idx + (np.arange(d, dtype=object) * s).reshape(shape)
    return data[idx.astype(np.int64)] if n else np.zeros(t.size, dtype=data.dtype)


def _import_and_compare(src: Path, out: Path, tensors: dict[str, Tensor]) -> None:
    """Import `src`; if it imports, its routes must hold exactly the ids torch would read (one layer, tokens in order)."""
    import_log("flame-pt", src, out)
    ref = {k: _reference(t) for k, t in tensors.items()}
    assert all(v is not None for v in ref.values()), f"imported tensors that reach outside their storage: {tensors}"
    assert ref["indices"] is not None
    routes = [r for r in trace.read(out)[1] if isinstance(r, trace.Route)]
    got = np.array([r.experts for r in routes], dtype=np.int64)
    assert np.array_equal(got, ref["indices"]), f"imported ids {got.tolist()}, torch reads {ref['indices']}"


def _zip(path: Path, pkl: bytes, tensors: dict[str, Tensor], deflate: bool) -> bytes:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        for t in tensors.values():
            z.writestr(f"archive/data/{t.key}", t.data.tobytes())
    return path.read_bytes()


def _zip_edit(data: bytes, header: int, field: str, value: int) -> bytes:
    """`data` with one field of its `header`-th zip header (local or central, in file order) set to `value`."""
    b = bytearray(data)
    starts = sorted(i for sig in (b"PK\x03\x04", b"PK\x01\x02") for i in _find_all(b, sig))
    if not starts:
        return data
    at = starts[header % len(starts)]
    central = b[at:at + 4] == b"PK\x01\x02"
    off, fmt = {"method": ((10 if central else 8), "<H"), "csize": ((20 if central else 18), "<I"),
                "usize": ((24 if central else 22), "<I")}[field]
    if at + off + struct.calcsize(fmt) <= len(b):
        struct.pack_into(fmt, b, at + off, value % (1 << (8 * struct.calcsize(fmt))))
    return bytes(b)


def _find_all(b: bytearray, sig: bytes) -> list[int]:
    out, i = [], b.find(sig)
    while i >= 0:
        out.append(i)
        i = b.find(sig, i + 1)
    return out


ZIP_FIELDS = ["method", "csize", "usize"]
ZIP_VALUE = st.sampled_from([0, 8, 12, 14, 99, 2**32 - 1, 2**31]) | st.integers(0, 2**32 - 1)
# fewer: each example writes and unpickles a zip
PT_FUZZ = settings(examples(80), database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.slow
@PT_FUZZ
@given(edits=st.dictionaries(st.sampled_from(["samples", "scores", "indices"]), TENSOR_EDIT, max_size=3),
       meta=META_EDIT, deflate=st.booleans())
def test_crafted_tensor_metadata_fails_only_with_an_import_error(edits: dict[str, dict[str, Any]],
                                                                 meta: dict[str, Any], deflate: bool,
                                                                 tmp_path: Path) -> None:
    ts = _edit_tensors(edits)
    src = tmp_path / "x.pt"
    _zip(src, pickled({**META, **meta}, ts), ts, deflate)
    assert _in_child(lambda: _import_and_compare(src, tmp_path / "out.qtrace", ts)) is None


@pytest.mark.slow
@PT_FUZZ
@given(pkl_edits=edits_st, zip_edits=st.lists(st.tuples(st.integers(0, 20), st.sampled_from(ZIP_FIELDS), ZIP_VALUE),
                                               max_size=3),
       byte_edits=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=3), deflate=st.booleans())
def test_a_corrupt_pickle_or_zip_fails_only_with_an_import_error(pkl_edits: list[tuple[int, int]],
                                                                 zip_edits: list[tuple[int, str, int]],
                                                                 byte_edits: list[tuple[int, int]], deflate: bool,
                                                                 tmp_path: Path) -> None:
    ts = capture_tensors(8)
    src = tmp_path / "x.pt"
    data = _zip(src, _mutate(pickled(META, ts), pkl_edits, None), ts, deflate)
    for header, field, value in zip_edits:
        data = _zip_edit(data, header, field, value)
    src.write_bytes(_mutate(data, byte_edits, None))
    assert _in_child(lambda: import_log("flame-pt", src, tmp_path / "out.qtrace")) is None


def test_the_child_reports_a_crash_a_memory_error_and_a_foreign_exception() -> None:
    """The harness itself: what it must catch, it catches (else the fuzzers above could not fail)."""
    import ctypes

    import numpy as np

    assert _in_child(lambda: ctypes.string_at(0)) == "killed by signal SIGSEGV"
    assert (_in_child(lambda: np.ones(4 << 30, dtype=np.uint8)) or "").startswith("MemoryError")
    assert _in_child(lambda: {}["x"]) == "KeyError: 'x'"
    assert _in_child(lambda: import_log("flame-pt", Path("/nonexistent.pt"), Path("/tmp/x"))) is None
