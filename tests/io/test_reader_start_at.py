"""`SsdReader.start_at`: reads at targets planned once per destination, with no request or plan per read.

The same bytes, results, statistics, retries and fallbacks as `start`; the requests asked for only when a read
fails; a target planned before a file fell back to the page cache is not used.
"""

from __future__ import annotations

import msgspec
import pytest
from test_reader import TINY4_RECORD, all_keys, expected, requests_for
from test_reader_start import DIRECT, finish, lying_destination

from qnpipe.errors import ReadError
from qnpipe.io import ssd
from qnpipe.io.reader import CacheMode, ReadRequest, alloc_aligned
from qnpipe.io.ssd import PendingRead, Prepared, SsdReader

pytestmark = pytest.mark.skipif(not ssd.c_extension_available(), reason="C extension not built")


class Asked:
    """`start_at`'s `requests`, counting its calls."""

    def __init__(self, reqs: list[ReadRequest]) -> None:
        self.reqs = reqs
        self.calls = 0

    def __call__(self) -> list[ReadRequest]:
        self.calls += 1
        return self.reqs


def _at(reader: SsdReader, reqs: list[ReadRequest]) -> list[tuple[ssd.Target, int]]:
    out = []
    for r in reqs:
        assert isinstance(r.buf, Prepared)
        target = reader.target(r.path, r.buf)
        assert target is not None
        out.append((target, r.offset))
    return out


def _prepared(reader: SsdReader, reqs: list[ReadRequest]) -> list[ReadRequest]:
    return [msgspec.structs.replace(r, buf=reader.prepare(r.buf, r.nbytes)) for r in reqs]


@pytest.mark.parametrize("nocache", [True, False])
@pytest.mark.parametrize("method", ["poll", "poll_nbytes"])
def test_start_at_reads_and_counts_what_start_does(store, note, nocache, method) -> None:
    root, index = store
    keys = all_keys(index)[::-1]
    got, stats = [], []
    for way in ("start", "start_at"):
        bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
        with SsdReader(workers=3, nocache=nocache, backend="c") as reader:
            reqs = _prepared(reader, requests_for(root, index, keys, bufs))
            asked = Asked(reqs)
            pending = reader.start(reqs, note.w) if way == "start" else reader.start_at(_at(reader, reqs), note.w, asked)
            got.append(finish(pending, note, method))
            stats.append(msgspec.structs.replace(reader.statistics(), read_s=0.0))
        for (layer, expert), buf in zip(keys, bufs, strict=True):
            assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert), (way, layer, expert)
        # whole reads answered by `poll_nbytes` never ask for the requests; `poll` builds its results from them
        assert asked.calls == (1 if way == "start_at" and method == "poll" else 0)
    assert got[0] == got[1]
    assert stats[0] == stats[1] and stats[0].reads == len(keys) and stats[0].batches == 1


@pytest.mark.parametrize("method", ["poll", "poll_nbytes"])
def test_a_short_read_at_a_target_is_retried_once_then_raised(tmp_path, note, method) -> None:
    path = tmp_path / "layer.bin"
    path.write_bytes(b"\7" * 3 * 4096)
    with SsdReader(backend="c") as reader:
        reqs = [ReadRequest(path=str(path), offset=2 * 4096, nbytes=8192, buf=reader.prepare(alloc_aligned(8192), 8192),
                            layer=4, expert=9),
                ReadRequest(path=str(path), offset=0, nbytes=8192, buf=reader.prepare(alloc_aligned(8192), 8192),
                            layer=4, expert=0)]
        asked = Asked(reqs)
        pending = reader.start_at(_at(reader, reqs), note.w, asked)
        note.wait()
        assert getattr(pending, method)() is None  # expert 9 failed: on the device again
        assert asked.calls == 1
        note.wait()
        with pytest.raises(ReadError, match=r"expert 9 of layer 4: short read: 4096 of 8192 bytes"):
            getattr(pending, method)()
        s = reader.statistics()
    assert (s.retries, s.errors, s.reads) == (1, 1, 0)
    assert asked.calls == 1 and note.idle()


@DIRECT
def test_a_refused_direct_read_at_a_target_goes_buffered_and_stales_the_targets(store, note, monkeypatch) -> None:
    # As tests/io/test_reader_start.py's: a destination wrongly taken for aligned is refused (EINVAL), the file is
    # reopened buffered and read again; a target planned before then is not used, one planned after reads buffered.
    root, index = store
    misaligned = lying_destination(monkeypatch)
    keys = [(1, 2)]
    with SsdReader(workers=2, backend="c") as reader:
        reqs = _prepared(reader, requests_for(root, index, keys, [misaligned]))
        before = _at(reader, reqs)
        assert before[0][0].mode is CacheMode.O_DIRECT and reader.epoch == 0
        results = finish(reader.start_at(before, note.w, Asked(reqs)), note)
        assert reader.epoch == 1
        stale = Asked(reqs)
        wakes = note.wakes
        again = finish(reader.start_at(before, note.w, stale), note)  # through `start`: the requests at once
        assert stale.calls == 1 and note.wakes == wakes + 1  # planned buffered: not refused first
        after = _at(reader, reqs)
        fresh = Asked(reqs)
        third = finish(reader.start_at(after, note.w, fresh), note, "poll_nbytes")
        stats = reader.statistics()
    assert after[0][0].mode is CacheMode.PAGE_CACHE and fresh.calls == 0
    assert results[0].mode is CacheMode.PAGE_CACHE and results[0].attempts == 1 and results == again
    assert third == [TINY4_RECORD]
    assert stats.direct_fallbacks == 1 and stats.retries == 0 and stats.batches == 3
    assert bytes(misaligned[:TINY4_RECORD]) == expected(root, index.layers[1], 2)


@DIRECT
def test_a_bounced_destination_has_no_target_and_an_unaligned_offset_goes_through_start(store, note) -> None:
    root, index = store
    lf = index.layers[1]
    path = str(root / "experts" / lf.file)
    with SsdReader(workers=2, backend="c") as reader:
        assert reader.target(path, reader.prepare(bytearray(TINY4_RECORD), TINY4_RECORD)) is None
        buf = reader.prepare(alloc_aligned(TINY4_RECORD), 100)
        target = reader.target(path, buf)
        assert target is not None
        req = ReadRequest(path=path, offset=4 * lf.stride + 1000, nbytes=100, buf=buf)
        asked = Asked([req])
        results = finish(reader.start_at([(target, req.offset)], note.w, asked), note)
    assert asked.calls == 1 and results[0].bounced
    assert bytes(memoryview(buf.dest[0])[:100]) == expected(root, lf, 4)[1000:1100]


def test_start_at_needs_the_c_backend_without_checksums(store) -> None:
    with SsdReader(backend="c", verify_crc32=True) as r, pytest.raises(RuntimeError, match="start_at needs"):
        r.start_at([], 0, list)
    r = SsdReader(backend="c")
    r.close()
    with pytest.raises(RuntimeError, match="closed"):
        r.start_at([], 0, list)


def test_an_empty_batch_at_targets_is_answered(note) -> None:
    with SsdReader(backend="c") as reader:
        pending = reader.start_at([], note.w, list)
        assert isinstance(pending, PendingRead)
        assert finish(pending, note, "poll_nbytes") == []
