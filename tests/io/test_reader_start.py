"""`SsdReader.start`: reads put on the C reader's threads from an event loop, completion on a file descriptor.

The same bytes, results, retries and fallbacks as `read_batch`; bounced bytes copied home by the
reader's threads; `Prepared` destinations; the C pool's `submit` itself.
"""

from __future__ import annotations

import os
import select
import time

import msgspec
import numpy as np
import pytest
from test_reader import (
    BIG_RECORD,
    BIG_TENSORS,
    TINY4_RECORD,
    _check_slots,
    _pool,
    _scatter_requests,
    all_keys,
    expected,
    requests_for,
    write_store,
)

from qnpipe.errors import ReadError
from qnpipe.io import ssd
from qnpipe.io.reader import ALIGN, CacheMode, ReadRequest, alloc_aligned
from qnpipe.io.ssd import PendingRead, Prepared, SsdReader, nocache_mode

pytestmark = pytest.mark.skipif(not ssd.c_extension_available(), reason="C extension not built")
DIRECT = pytest.mark.skipif(nocache_mode(True) is not CacheMode.O_DIRECT, reason="O_DIRECT is Linux-only")


class Notify:
    """A wake-up pair as the live device keeps one: an eventfd on Linux, else a pipe."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.r = self.w = os.eventfd(0, os.EFD_CLOEXEC)
        else:
            self.r, self.w = os.pipe()
        self.wakes = 0

    def wait(self) -> None:
        ready, _, _ = select.select([self.r], [], [], 30)
        assert ready, "the reader never wrote its notify fd"
        assert len(os.read(self.r, 8)) == 8
        self.wakes += 1

    def idle(self) -> bool:
        return not select.select([self.r], [], [], 0)[0]

    def close(self) -> None:
        for fd in {self.r, self.w}:
            os.close(fd)


def lying_destination(monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """A destination `prepare` wrongly takes for aligned from now on: a direct read into it is refused (EINVAL)."""
    backing = alloc_aligned(TINY4_RECORD + 2 * ALIGN)
    misaligned = backing[8 : 8 + 4 * ALIGN]
    real = ssd.prepare

    def lying(buf, nbytes, where="a read"):
        p = real(buf, nbytes, where)
        return Prepared(p.nbytes, p.dest, (misaligned.data.cast("B"),))

    monkeypatch.setattr(ssd, "prepare", lying)
    return misaligned


def finish(pending: PendingRead, note: Notify, method: str = "poll") -> list:
    """Drive `pending` as the device does: wait for the fd, poll, again while it says another attempt is out."""
    while True:
        note.wait()
        out = getattr(pending, method)()
        if out is not None:
            assert note.idle()  # written once per attempt, no more
            return out


@pytest.mark.parametrize("nocache", [True, False])
def test_start_reads_what_read_batch_reads(store, note, nocache) -> None:
    root, index = store
    keys = all_keys(index)[::-1]
    with SsdReader(workers=3, nocache=nocache, backend="c") as reader:
        assert reader.starts
        a = [alloc_aligned(TINY4_RECORD) for _ in keys]
        b = [alloc_aligned(TINY4_RECORD) for _ in keys]
        before = time.perf_counter()
        pending = reader.start(requests_for(root, index, keys, a), note.w)
        got = finish(pending, note)
        want = reader.read_batch(requests_for(root, index, keys, b))
        stats = reader.statistics()
    assert got == want
    for (layer, expert), buf in zip(keys, a, strict=True):
        assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)
    assert (stats.batches, stats.reads, stats.retries, stats.errors) == (2, 2 * len(keys), 0, 0)
    assert note.wakes == 1
    # a reader thread took the first read once it was handed over, then the last one ended: both may come before
    # `start` returns (t_start), the whole batch too when the page cache has it
    assert before <= pending.t_started <= pending.t_done and before <= pending.t_start


@DIRECT
def test_bounced_bytes_are_copied_home_by_the_reader(store, note) -> None:
    root, index = store
    lf = index.layers[1]
    path = str(root / "experts" / lf.file)
    backing = alloc_aligned(TINY4_RECORD + ALIGN)
    misaligned = backing[1 : 1 + TINY4_RECORD]
    short_buf = bytearray(TINY4_RECORD)  # not padded to 4096
    tail = bytearray(100)
    last = lf.num_experts - 1
    reqs = [
        ReadRequest(path=path, offset=3 * lf.stride, nbytes=TINY4_RECORD, buf=misaligned, layer=1, expert=3),
        ReadRequest(path=path, offset=last * lf.stride, nbytes=TINY4_RECORD, buf=short_buf, layer=1, expert=last),
        ReadRequest(path=path, offset=4 * lf.stride + 1000, nbytes=100, buf=tail),  # unaligned offset
        ReadRequest(path=path, offset=2 * lf.stride, nbytes=TINY4_RECORD, buf=alloc_aligned(TINY4_RECORD)),
    ]
    with SsdReader(workers=2, backend="c") as reader:
        results = finish(reader.start(reqs, note.w), note)
        stats = reader.statistics()
    assert [r.bounced for r in results] == [True, True, True, False]
    assert stats.bounced_reads == 3
    assert bytes(misaligned) == expected(root, lf, 3)
    assert bytes(short_buf) == expected(root, lf, last)
    assert bytes(tail) == expected(root, lf, 4)[1000:1100]


@pytest.mark.parametrize("nocache", [True, False])
@pytest.mark.parametrize("prepared", [True, False])
def test_scatter_into_slots_with_prepared_destinations(tmp_path, note, nocache, prepared) -> None:
    index = write_store(tmp_path, layers=2, experts=6, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    pools = [_pool(lf, 4) for lf in index.layers]
    keys = [(0, 5), (1, 0), (0, 2), (1, 3)]
    slots = [3, 0, 1, 2]
    reqs = _scatter_requests(tmp_path, index, keys, pools, slots)
    with SsdReader(workers=2, backend="c", nocache=nocache) as reader:
        if prepared:
            reqs = [ReadRequest(path=r.path, offset=r.offset, nbytes=r.nbytes, layer=r.layer, expert=r.expert,
                                buf=reader.prepare(r.buf, r.nbytes)) for r in reqs]
        results = finish(reader.start(reqs, note.w), note)
        again = finish(reader.start(reqs, note.w), note)  # a prepared destination serves every read
    _check_slots(tmp_path, index, keys, pools, slots)
    assert results == again and not any(r.bounced for r in results)


def test_prepared_checks_its_destination(store) -> None:
    root, index = store
    buf = alloc_aligned(TINY4_RECORD)
    p = ssd.prepare(buf, TINY4_RECORD)
    assert isinstance(p, Prepared) and p.nbytes == TINY4_RECORD and p.direct is not None
    assert ssd.prepare(bytearray(TINY4_RECORD), TINY4_RECORD).direct is None  # not a whole aligned block
    with pytest.raises(ValueError, match="read-only"):
        ssd.prepare(bytes(TINY4_RECORD), TINY4_RECORD, "layer 1 slot 2")
    with pytest.raises(ValueError, match=r"layer 1 slot 2 hold 10 bytes < nbytes 100"):
        ssd.prepare(bytearray(10), 100, "layer 1 slot 2")
    lf = index.layers[0]
    req = ReadRequest(path=str(root / "experts" / lf.file), offset=0, nbytes=100, buf=p)
    with SsdReader(backend="c") as reader, pytest.raises(ValueError, match="prepared for 13824"):
        reader.read_batch([req])


def test_a_short_read_is_retried_once_then_raised(tmp_path, note) -> None:
    path = tmp_path / "layer.bin"
    path.write_bytes(b"\7" * 3 * 4096)
    reqs = [ReadRequest(path=str(path), offset=2 * 4096, nbytes=8192, buf=alloc_aligned(8192), layer=4, expert=9),
            ReadRequest(path=str(path), offset=0, nbytes=4096, buf=alloc_aligned(4096), layer=4, expert=0)]
    with SsdReader(backend="c") as reader:
        pending = reader.start(reqs, note.w)
        note.wait()
        assert pending.poll() is None  # expert 9 failed: on the device again
        note.wait()
        with pytest.raises(ReadError, match=r"expert 9 of layer 4: short read: 4096 of 8192 bytes"):
            pending.poll()
        s = reader.statistics()
    assert (s.retries, s.errors, s.reads) == (1, 1, 0)
    assert note.idle()


@DIRECT
def test_a_refused_direct_read_goes_buffered(store, note, monkeypatch) -> None:
    # A destination wrongly taken for aligned: the file system answers the direct read EINVAL, as one
    # that opens O_DIRECT but refuses its reads does; the reader reopens the file buffered and reads again.
    root, index = store
    misaligned = lying_destination(monkeypatch)
    keys = [(1, 2)]
    with SsdReader(workers=2, backend="c") as reader:
        results = finish(reader.start(requests_for(root, index, keys, [misaligned]), note.w), note)
        stats = reader.statistics()
    assert results[0].mode is CacheMode.PAGE_CACHE and results[0].attempts == 1
    assert stats.direct_fallbacks == 1 and stats.retries == 0
    assert bytes(misaligned[:TINY4_RECORD]) == expected(root, index.layers[1], 2)
    assert note.wakes == 2


def test_start_is_offered_by_the_c_backend_without_checksums() -> None:
    with SsdReader(backend="python") as r:
        assert not r.starts
        with pytest.raises(RuntimeError, match="C backend"):
            r.start([], 0)
    with SsdReader(backend="c", verify_crc32=True) as r:
        assert not r.starts
    r = SsdReader(backend="c")
    r.close()
    with pytest.raises(RuntimeError, match="closed"):
        r.start([], 0)


# ---------------------------------------------------------------------------- the C pool's submit


def test_pool_submit_copies_and_checks(tmp_path, note) -> None:
    from qnpipe.io import _preadx

    data = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    path = tmp_path / "f.bin"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    pool = _preadx.Pool(3)
    try:
        bufs = [np.zeros(4096, np.uint8) for _ in range(5)]
        d1, d2 = np.zeros(100, np.uint8), np.zeros(200, np.uint8)
        ops = [(fd, i * 4096, 4096, bufs[i]) for i in range(4)] + [(fd, 8192, 4096, bufs[4], (10, (d1, d2)))]
        batch = pool.submit(ops, note.w)
        note.wait()
        with pytest.raises(RuntimeError, match="t_started is known after wait"):
            _ = batch.t_started
        assert batch.done and batch.wait() == [4096] * 5 and batch.wait() == [4096] * 5
        assert isinstance(batch.t_done, float) and batch.t_started <= batch.t_done  # the first read's take, its end
        for i in range(4):
            assert (bufs[i] == data[i * 4096 : (i + 1) * 4096]).all()
        assert (d1 == data[8192 + 10 : 8192 + 110]).all() and (d2 == data[8192 + 110 : 8192 + 310]).all()
        empty = pool.submit([], note.w)  # nothing to read: done, and the loop is told all the same
        note.wait()
        assert empty.wait() == []
        # a read short of its copy's end copies nothing
        short = np.zeros(4096, np.uint8)
        d3 = np.full(50, 9, np.uint8)
        tail = pool.submit([(fd, (1 << 16) - 20, 100, short, (0, (d3,)))], note.w)
        note.wait()
        assert tail.wait() == [20] and (d3 == 9).all()
        with pytest.raises(ValueError, match="the copy takes bytes 0..100 of a 10-byte read"):
            pool.submit([(fd, 0, 10, bufs[0], (0, (d1,)))], note.w)
        with pytest.raises(ValueError, match="one .bounce. buffer"):
            pool.submit([(fd, 0, 4096, (bufs[0], bufs[1]), (0, (d1,)))], note.w)
        with pytest.raises(ValueError, match="notify_fd"):
            pool.submit(ops, -1)
        with pytest.raises(TypeError, match="op 0 must be a tuple"):
            pool.submit([(fd, 0)], note.w)
        pending = pool.submit(ops, note.w)
        del pending  # dropped on the device: waits for its reads before letting go of the buffers
        note.wait()
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit(ops, note.w)
    finally:
        pool.close()
        os.close(fd)
    assert note.idle()


def test_the_loop_yields_its_cpu_once_per_batch_it_hands_over(store, note, monkeypatch) -> None:
    # The woken reader thread may be waiting for this very CPU (docs/measurements.md): one yield per start.
    from qnpipe.io import pending

    root, index = store
    keys = all_keys(index)[:2]
    yields: list[int] = []
    monkeypatch.setattr(pending.os, "sched_yield", lambda: yields.append(1))
    with SsdReader(workers=2, nocache=False, backend="c") as reader:
        bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
        finish(reader.start(requests_for(root, index, keys, bufs), note.w), note)
        assert len(yields) == 1
        monkeypatch.setattr(pending, "_yield_after_start", False)
        finish(reader.start(requests_for(root, index, keys, bufs), note.w), note)
        assert len(yields) == 1


def _three_ways(root, index, tmp_path) -> list[tuple[str, list[ReadRequest]]]:
    """Batches of whole reads, bounced reads (direct I/O: misaligned memory, an unaligned offset), a short read."""
    keys = all_keys(index)
    lf = index.layers[1]
    path = str(root / "experts" / lf.file)
    short = tmp_path / "short.bin"
    short.write_bytes(b"\7" * 3 * 4096)
    return [
        ("whole", requests_for(root, index, keys, [alloc_aligned(TINY4_RECORD) for _ in keys])),
        ("bounced", [ReadRequest(path=path, offset=3 * lf.stride, nbytes=TINY4_RECORD,
                                 buf=alloc_aligned(TINY4_RECORD + ALIGN)[1 : 1 + TINY4_RECORD], layer=1, expert=3),
                     ReadRequest(path=path, offset=4 * lf.stride + 1000, nbytes=100, buf=bytearray(100))]),
        ("short", [ReadRequest(path=str(short), offset=2 * 4096, nbytes=8192, buf=alloc_aligned(8192), layer=4,
                               expert=9)]),
    ]


@pytest.mark.parametrize("nocache", [True, False])
def test_poll_nbytes_answers_and_counts_as_poll(store, note, tmp_path, monkeypatch, nocache) -> None:
    """The live device's quick answer: the bytes `poll`'s results give, the same statistics, the same errors."""
    root, index = store
    got: dict[str, list] = {}
    polls = []
    poll = PendingRead.poll
    monkeypatch.setattr(PendingRead, "poll", lambda self: polls.append(1) or poll(self))
    for method in ("poll", "poll_nbytes"):
        with SsdReader(workers=3, nocache=nocache, backend="c") as reader:
            for kind, reqs in _three_ways(root, index, tmp_path):
                if kind == "short":
                    with pytest.raises(ReadError, match=r"expert 9 of layer 4: short read"):
                        finish(reader.start(reqs, note.w), note, method)
                    continue
                pending = reader.start(reqs, note.w)
                out = finish(pending, note, method)
                got.setdefault(kind, []).append([r if isinstance(r, int) else r.nbytes for r in out])
                assert pending.t_started <= pending.t_done
                for r in reqs:
                    if r.layer >= 0:
                        assert bytes(memoryview(r.buf)[: r.nbytes]) == expected(root, index.layers[r.layer], r.expert)
            got.setdefault("stats", []).append(msgspec.structs.replace(reader.statistics(), read_s=0.0))
    for kind, (by_poll, by_nbytes) in got.items():
        assert by_poll == by_nbytes, kind
    # `poll` ran 4 times (the short read's two attempts); under `poll_nbytes`, only for the short read's
    assert len(polls) == 4 + 2
    assert got["stats"][0].reads > 0 and got["stats"][0].errors == 1
