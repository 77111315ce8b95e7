"""Fuzzing the importers' sources: a mutated or cut source raises TraceImportError (or imports), nothing else."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from deadline import deadline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_traces import MARIO, WEIRAN

from qnpipe.errors import TraceImportError
from qnpipe.importers import import_log

FUZZ = settings(max_examples=60, deadline=None, database=None,
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
