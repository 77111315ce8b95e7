"""The SSD expert reader: both backends, direct-I/O alignment, fallbacks, retries, checksums.

The stores here are written by a small helper that follows `qnpipe/io/store_format.py`
(random record bytes, correct crc32s, an index.json), not by `qnpipe convert`.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

from qnpipe.config import ReadBackend
from qnpipe.errors import ReadError
from qnpipe.io import ssd
from qnpipe.io.reader import (
    ALIGN,
    CacheMode,
    ReadRequest,
    aligned_len,
    alloc_aligned,
    buffer_address,
    mlx_aligned_buffer,
    scatter_buffers,
)
from qnpipe.io.ssd import SsdReader, nocache_mode
from qnpipe.io.store_format import INDEX_FILE, LayerFile, Quant, StoreIndex, TensorSlot

BACKENDS = [
    pytest.param(ReadBackend.C, marks=pytest.mark.skipif(not ssd.c_extension_available(), reason="C extension not built")),
    ReadBackend.PYTHON,
]

# The tiny 4-bit test model's expert (H=128, I=64, group 64): 3 x (4096 + 256 + 256) bytes.
TINY4_TENSORS = tuple(
    TensorSlot(name=f"{proj}.{part}", dtype=dt, shape=shape, offset=k * 4608 + off, nbytes=nb)
    for k, proj in enumerate(("gate_proj", "up_proj", "down_proj"))
    for part, dt, shape, off, nb in (
        ("weight", "uint32", (64, 16) if proj != "down_proj" else (128, 8), 0, 4096),
        ("scales", "bfloat16", (64, 2) if proj != "down_proj" else (128, 1), 4096, 256),
        ("biases", "bfloat16", (64, 2) if proj != "down_proj" else (128, 1), 4352, 256),
    )
)
TINY4_RECORD = 3 * 4608  # 13824: not a multiple of 4096, stride 16384


# An 80B-like record, scaled down: every tensor a multiple of 4096 bytes (the 80B's are 512 KiB
# and 32 KiB), so a record scatters into per-tensor slot arrays with direct I/O in place.
BIG_TENSORS = tuple(
    TensorSlot(name=f"{proj}.{part}", dtype=dt, shape=shape, offset=k * 16384 + off, nbytes=nb)
    for k, proj in enumerate(("gate_proj", "up_proj", "down_proj"))
    for part, dt, shape, off, nb in (
        ("weight", "uint32", (64, 32), 0, 8192),
        ("scales", "bfloat16", (64, 32), 8192, 4096),
        ("biases", "bfloat16", (64, 32), 12288, 4096),
    )
)
BIG_RECORD = 3 * 16384


def write_store(root: Path, *, layers: int = 3, experts: int = 8, record_nbytes: int = TINY4_RECORD,
                seed: int = 0, tensors: tuple[TensorSlot, ...] | None = None) -> StoreIndex:
    """Write `root/experts/` following store_format.py: one file per layer, expert e at
    e * stride, random record bytes, crc32 per record, index.json. The last record of a
    layer file is not padded, so the file ends unaligned."""
    rng = np.random.default_rng(seed)
    stride = aligned_len(record_nbytes)
    exp_dir = root / "experts"
    exp_dir.mkdir(parents=True)
    files = []
    for layer in range(layers):
        records = [rng.integers(0, 256, record_nbytes, dtype=np.uint8).tobytes() for _ in range(experts)]
        blob = b"".join(r + b"\0" * (stride - record_nbytes) for r in records)[: (experts - 1) * stride + record_nbytes]
        name = f"layer_{layer:03d}.bin"
        (exp_dir / name).write_bytes(blob)
        files.append(LayerFile(
            layer=layer, file=name, num_experts=experts, stride=stride, record_nbytes=record_nbytes,
            file_nbytes=len(blob),
            tensors=tensors if tensors is not None else TINY4_TENSORS if record_nbytes == TINY4_RECORD else (),
            quant={p: Quant(bits=4, group_size=64) for p in ("gate_proj", "up_proj", "down_proj")},
            checksums=tuple(zlib.crc32(r) for r in records),
        ))
    index = StoreIndex(model_id="test", layers=tuple(files))
    (exp_dir / INDEX_FILE).write_bytes(msgspec.json.encode(index))
    return index


def load_index(root: Path) -> StoreIndex:
    return msgspec.json.decode((root / "experts" / INDEX_FILE).read_bytes(), type=StoreIndex)


def expected(root: Path, lf: LayerFile, expert: int) -> bytes:
    with open(root / "experts" / lf.file, "rb") as f:
        f.seek(expert * lf.stride)
        return f.read(lf.record_nbytes)


def requests_for(root: Path, index: StoreIndex, keys: list[tuple[int, int]], bufs: list) -> list[ReadRequest]:
    out = []
    for (layer, expert), buf in zip(keys, bufs, strict=True):
        lf = index.layers[layer]
        out.append(ReadRequest(
            path=str(root / "experts" / lf.file), offset=expert * lf.stride, nbytes=lf.record_nbytes, buf=buf,
            layer=layer, expert=expert, crc32=lf.checksums[expert],
        ))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, StoreIndex]:
    root = tmp_path_factory.mktemp("store")
    return root, write_store(root)


def all_keys(index: StoreIndex) -> list[tuple[int, int]]:
    return [(lf.layer, e) for lf in index.layers for e in range(lf.num_experts)]


class Recorder:
    """A preadv hook (Python backend) that records every call and can inject faults.

    `fault(fd, bufs, offset)` returns None to do the real read, or a byte count / raises."""

    def __init__(self, fault=None) -> None:
        self.calls: list[tuple[int, int, list[tuple[int, int]]]] = []  # fd, offset, [(address, length)]
        self.fault = fault
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def __call__(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        with self.lock:
            self.calls.append((fd, offset, [(buffer_address(b), b.nbytes) for b in bufs]))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fault is not None:
                r = self.fault(fd, bufs, offset)
                if r is not None:
                    return r
            return os.preadv(fd, bufs, offset)
        finally:
            with self.lock:
                self.in_flight -= 1


# ---------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nocache", [True, False])
def test_reads_every_record_exactly(store, backend, nocache) -> None:
    root, index = store
    keys = all_keys(index)[::-1]
    bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
    with SsdReader(workers=4, nocache=nocache, backend=backend, verify_crc32=True) as reader:
        results = reader.read_batch(requests_for(root, index, keys, bufs))
        stats = reader.statistics()
    for (layer, expert), buf, res in zip(keys, bufs, results, strict=True):
        assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)
        assert (res.layer, res.expert, res.attempts, res.verified, res.bounced) == (layer, expert, 1, True, False)
        assert res.mode == (nocache_mode(True) if nocache else CacheMode.PAGE_CACHE)
    assert stats.backend == backend.value
    assert (stats.batches, stats.reads, stats.bytes_read) == (1, len(keys), len(keys) * TINY4_RECORD)
    assert (stats.retries, stats.errors, stats.bounced_reads, stats.checksum_failures) == (0, 0, 0, 0)
    assert stats.verified_reads == len(keys)


@pytest.mark.skipif(not ssd.c_extension_available(), reason="C extension not built")
def test_c_extension_and_fallback_give_identical_bytes(tmp_path) -> None:
    root = tmp_path
    index = write_store(root, layers=2, experts=6, record_nbytes=3 * 4096 + 100, seed=3)
    rng = np.random.default_rng(1)
    keys = [(int(rng.integers(2)), int(rng.integers(6))) for _ in range(40)]
    out = {}
    for backend in (ReadBackend.C, ReadBackend.PYTHON):
        bufs = [alloc_aligned(index.layers[0].record_nbytes) for _ in keys]
        with SsdReader(workers=3, backend=backend) as reader:
            reader.read_batch(requests_for(root, index, keys, bufs))
        out[backend] = b"".join(bytes(b) for b in bufs)
    assert out[ReadBackend.C] == out[ReadBackend.PYTHON]
    assert out[ReadBackend.C][: index.layers[0].record_nbytes] == expected(root, index.layers[keys[0][0]], keys[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_larger_than_workers_and_concurrent_batches(store, backend) -> None:
    root, index = store
    keys = all_keys(index) * 3  # 72 reads on 2 workers
    with SsdReader(workers=2, backend=backend) as reader:
        errors: list[BaseException] = []

        def one(shift: int) -> None:
            ks = keys[shift:] + keys[:shift]
            bufs = [alloc_aligned(TINY4_RECORD) for _ in ks]
            try:
                reader.read_batch(requests_for(root, index, ks, bufs))
                for (layer, expert), buf in zip(ks, bufs, strict=True):
                    assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(s,)) for s in (0, 5, 11)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert reader.statistics().reads == 3 * len(keys)


def test_python_backend_keeps_at_most_workers_reads_in_flight(store) -> None:
    root, index = store
    keys = all_keys(index)
    hook = Recorder()
    with SsdReader(workers=3, preadv=hook) as reader:
        reader.read_batch(requests_for(root, index, keys, [alloc_aligned(TINY4_RECORD) for _ in keys]))
    assert len(hook.calls) == len(keys)
    assert 1 <= hook.max_in_flight <= 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend) -> None:
    with SsdReader(backend=backend) as reader:
        assert reader.read_batch([]) == []
        assert reader.statistics().batches == 0


# ---------------------------------------------------------------------------- direct I/O alignment


@pytest.mark.skipif(nocache_mode(True) is not CacheMode.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_direct_reads_are_aligned_and_misaligned_requests_bounce(store) -> None:
    root, index = store
    lf = index.layers[1]
    path = str(root / "experts" / lf.file)
    hook = Recorder()
    aligned = alloc_aligned(TINY4_RECORD)
    backing = alloc_aligned(TINY4_RECORD + ALIGN)
    misaligned_buf = backing[1 : 1 + TINY4_RECORD]  # address 1 past a page, exactly nbytes long
    short_buf = bytearray(TINY4_RECORD)  # not padded to 4096
    tail = bytearray(100)
    last = lf.num_experts - 1  # its aligned read runs past the (unaligned) end of the file
    reqs = [
        ReadRequest(path=path, offset=2 * lf.stride, nbytes=TINY4_RECORD, buf=aligned, layer=1, expert=2),
        ReadRequest(path=path, offset=3 * lf.stride, nbytes=TINY4_RECORD, buf=misaligned_buf, layer=1, expert=3),
        ReadRequest(path=path, offset=last * lf.stride, nbytes=TINY4_RECORD, buf=short_buf, layer=1, expert=last),
        ReadRequest(path=path, offset=4 * lf.stride + 1000, nbytes=100, buf=tail),  # unaligned offset
        ReadRequest(path=path, offset=last * lf.stride, nbytes=TINY4_RECORD,
                    buf=alloc_aligned(TINY4_RECORD), layer=1, expert=last),
    ]
    with SsdReader(workers=2, preadv=hook) as reader:
        results = reader.read_batch(reqs)
        stats = reader.statistics()
    assert [r.mode for r in results] == [CacheMode.O_DIRECT] * 5
    assert [r.bounced for r in results] == [False, True, True, True, False]
    assert stats.bounced_reads == 3 and stats.direct_fallbacks == 0
    for _fd, offset, bufs in hook.calls:
        assert offset % ALIGN == 0 and all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in bufs)
    assert bytes(aligned[:TINY4_RECORD]) == expected(root, lf, 2)
    assert bytes(misaligned_buf) == expected(root, lf, 3)
    assert bytes(short_buf) == expected(root, lf, last)
    assert bytes(tail) == expected(root, lf, 4)[1000:1100]
    assert bytes(reqs[4].buf[:TINY4_RECORD]) == expected(root, lf, last)


def test_alloc_aligned() -> None:
    for n in (1, 4096, 13824, 1769472):
        buf = alloc_aligned(n)
        assert buf.nbytes == aligned_len(n) and buf.nbytes % ALIGN == 0
        assert buffer_address(buf) % ALIGN == 0 and buf.flags.writeable


# ---------------------------------------------------------------------------- fallbacks


def test_buffered_fallback_when_open_refuses_o_direct(store, monkeypatch) -> None:
    root, index = store
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(ssd, "nocache_mode", lambda nocache: CacheMode.O_DIRECT)
    monkeypatch.setattr(ssd.os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    monkeypatch.setattr(ssd.os, "open", refusing_open)
    keys = [(0, 1), (0, 2), (2, 7)]
    bufs = [bytearray(TINY4_RECORD) for _ in keys]  # unaligned is fine once buffered
    with SsdReader(workers=2, backend=ReadBackend.PYTHON) as reader:
        results = reader.read_batch(requests_for(root, index, keys, bufs))
        stats = reader.statistics()
    assert [r.mode for r in results] == [CacheMode.PAGE_CACHE] * 3
    assert not any(r.bounced for r in results)
    assert stats.direct_fallbacks == 2  # one per file
    for (layer, expert), buf in zip(keys, bufs, strict=True):
        assert bytes(buf) == expected(root, index.layers[layer], expert)


@pytest.mark.skipif(nocache_mode(True) is not CacheMode.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_buffered_fallback_when_a_direct_read_is_refused(store) -> None:
    root, index = store

    def einval_on_direct(fd, bufs, offset):  # a file system that opens O_DIRECT but refuses the reads
        if _is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return None

    hook = Recorder(einval_on_direct)
    keys = [(1, 0), (1, 5)]
    bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
    with SsdReader(workers=2, preadv=hook) as reader:
        results = reader.read_batch(requests_for(root, index, keys, bufs))
        stats = reader.statistics()
    assert [r.mode for r in results] == [CacheMode.PAGE_CACHE] * 2
    assert stats.direct_fallbacks == 1 and stats.retries == 0
    for (layer, expert), buf in zip(keys, bufs, strict=True):
        assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_f_nocache_on_macos(tmp_path, monkeypatch) -> None:
    assert nocache_mode(True, "darwin") is CacheMode.F_NOCACHE
    assert nocache_mode(True, "linux") is (CacheMode.O_DIRECT if hasattr(os, "O_DIRECT") else CacheMode.PAGE_CACHE)
    assert nocache_mode(False, "darwin") is CacheMode.PAGE_CACHE
    assert nocache_mode(True, "win32") is CacheMode.PAGE_CACHE
    import fcntl

    calls = []
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg=0: calls.append((cmd, arg)) or 0)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    with SsdReader(backend=ReadBackend.PYTHON) as reader:
        f = reader._open(str(path), CacheMode.F_NOCACHE)
        os.close(f.fd)
    assert f.mode is CacheMode.F_NOCACHE
    assert calls == [(getattr(fcntl, "F_NOCACHE", 48), 1)]


# ---------------------------------------------------------------------------- integrity


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_on_read_catches_a_flipped_byte(tmp_path, backend) -> None:
    index = write_store(tmp_path, layers=2, experts=4)
    lf = index.layers[1]
    path = tmp_path / "experts" / lf.file
    with open(path, "r+b") as f:  # flip one byte inside expert 2's record
        f.seek(2 * lf.stride + 777)
        b = f.read(1)
        f.seek(2 * lf.stride + 777)
        f.write(bytes([b[0] ^ 0x40]))
    keys = [(0, 1), (1, 1), (1, 2), (1, 3)]
    bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
    with SsdReader(workers=2, backend=backend, verify_crc32=True) as reader:
        with pytest.raises(ReadError) as info:
            reader.read_batch(requests_for(tmp_path, index, keys, bufs))
        stats = reader.statistics()
    err = info.value
    assert (err.layer, err.expert, err.path, err.offset) == (1, 2, str(path), 2 * lf.stride)
    msg = str(err)
    assert "expert 2 of layer 1" in msg and str(path) in msg and f"offset {2 * lf.stride}" in msg
    assert "crc32 mismatch" in msg
    assert (stats.retries, stats.checksum_failures, stats.errors) == (1, 2, 1)
    # Off by default: the same read goes through unchecked.
    with SsdReader(workers=2, backend=backend) as reader:
        reader.read_batch(requests_for(tmp_path, index, keys, bufs))
        assert reader.statistics().verified_reads == 0


def test_eio_is_retried_once_then_succeeds(store) -> None:
    root, index = store
    lf = index.layers[2]
    target = 5 * lf.stride
    failed = []

    def eio_once(fd, bufs, offset):
        if offset == target and not failed:
            failed.append(offset)
            raise OSError(errno.EIO, "Input/output error")
        return None

    keys = [(2, 4), (2, 5), (2, 6)]
    bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
    with SsdReader(workers=2, preadv=Recorder(eio_once)) as reader:
        results = reader.read_batch(requests_for(root, index, keys, bufs))
        stats = reader.statistics()
    assert [r.attempts for r in results] == [1, 2, 1]
    assert (stats.retries, stats.errors) == (1, 0)
    for (layer, expert), buf in zip(keys, bufs, strict=True):
        assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)


def test_persistent_eio_raises_naming_the_expert(store) -> None:
    root, index = store
    lf = index.layers[2]
    target = 5 * lf.stride
    seen = []

    def eio_always(fd, bufs, offset):
        if offset == target:
            seen.append(offset)
            raise OSError(errno.EIO, "Input/output error")
        return None

    keys = [(2, 4), (2, 5)]
    with SsdReader(workers=2, preadv=Recorder(eio_always)) as reader:
        with pytest.raises(ReadError, match=r"cannot read expert 5 of layer 2: EIO") as info:
            reader.read_batch(requests_for(root, index, keys, [alloc_aligned(TINY4_RECORD) for _ in keys]))
        assert reader.statistics().retries == 1
    assert len(seen) == 2  # the first read and exactly one retry
    assert (info.value.path, info.value.offset) == (str(root / "experts" / lf.file), target)


def test_short_read_is_retried_then_raised(store) -> None:
    root, index = store
    lf = index.layers[0]
    calls = []

    def truncated(fd, bufs, offset):  # the file seems to end 4096 bytes into expert 3
        calls.append(offset)
        if offset == 3 * lf.stride:
            return os.preadv(fd, [bufs[0][:4096]], offset)
        return 0 if offset > 3 * lf.stride else None

    keys = [(0, 3)]
    with SsdReader(workers=1, preadv=Recorder(truncated)) as reader:
        with pytest.raises(ReadError, match=r"expert 3 of layer 0: short read: \d+ of 13824 bytes") as info:
            reader.read_batch(requests_for(root, index, keys, [alloc_aligned(TINY4_RECORD)]))
    assert info.value.offset == 3 * lf.stride
    assert calls.count(3 * lf.stride) == 2


def test_partial_reads_are_resumed_without_a_retry(store) -> None:
    root, index = store

    def dribble(fd, bufs, offset):  # at most one page per call, like a signal-interrupted read
        return os.preadv(fd, [bufs[0][:4096]], offset)

    keys = all_keys(index)[:5]
    bufs = [alloc_aligned(TINY4_RECORD) for _ in keys]
    with SsdReader(workers=2, preadv=Recorder(dribble)) as reader:
        results = reader.read_batch(requests_for(root, index, keys, bufs))
        assert reader.statistics().retries == 0
    assert all(r.attempts == 1 for r in results)
    for (layer, expert), buf in zip(keys, bufs, strict=True):
        assert bytes(buf[:TINY4_RECORD]) == expected(root, index.layers[layer], expert)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file_and_bad_requests(tmp_path, backend) -> None:
    with SsdReader(backend=backend) as reader:
        with pytest.raises(FileNotFoundError):
            reader.read_batch([ReadRequest(path=str(tmp_path / "nope.bin"), offset=0, nbytes=10, buf=bytearray(10))])
        (tmp_path / "f.bin").write_bytes(b"\1" * 8192)
        path = str(tmp_path / "f.bin")
        with pytest.raises(ValueError, match="hold 5 bytes"):
            reader.read_batch([ReadRequest(path=path, offset=0, nbytes=10, buf=bytearray(5))])
        with pytest.raises(ValueError, match="read-only"):
            reader.read_batch([ReadRequest(path=path, offset=0, nbytes=10, buf=bytes(10))])
        with pytest.raises(ValueError, match="bad read request"):
            reader.read_batch([ReadRequest(path=path, offset=-4096, nbytes=10, buf=bytearray(10))])
    with pytest.raises(RuntimeError, match="closed"):
        reader.read_batch([ReadRequest(path=path, offset=0, nbytes=10, buf=bytearray(10))])
    reader.close()  # idempotent


# ---------------------------------------------------------------------------- backend selection


def test_without_the_extension_the_python_backend_is_chosen() -> None:
    choose = ssd.choose_backend
    assert choose("auto", hooked=False, c_available=False) is ReadBackend.PYTHON
    assert choose("auto", hooked=False, c_available=True) is ReadBackend.C
    assert choose("auto", hooked=True, c_available=True) is ReadBackend.PYTHON
    assert choose(ReadBackend.PYTHON, hooked=False, c_available=True) is ReadBackend.PYTHON
    with pytest.raises(ValueError, match="not built"):
        choose("c", hooked=False, c_available=False)
    with pytest.raises(ValueError, match="Python backend"):
        choose("c", hooked=True, c_available=True)
    with pytest.raises(ValueError, match="Python backend"):
        SsdReader(backend="c", preadv=os.preadv)  # the reader asks the same function


def test_auto_prefers_the_extension_when_built() -> None:
    with SsdReader() as reader:
        assert reader.backend is (ReadBackend.C if ssd.c_extension_available() else ReadBackend.PYTHON)


def test_from_config() -> None:
    from qnpipe import config as qnpipe_config
    from qnpipe.config import ReadCfg

    with SsdReader.from_config(ReadCfg(workers=3, nocache=False), backend=ReadBackend.PYTHON) as reader:
        s = reader.statistics()
    assert (s.workers, s.mode, s.backend) == (3, CacheMode.PAGE_CACHE, "python")
    with warnings.catch_warnings():
        # The reader reads these fields; the engine does not run it yet, so load() warns.
        warnings.simplefilter("ignore", qnpipe_config.NotImplementedConfigWarning)
        cfg = qnpipe_config.load(env={"QNPIPE_READ__BACKEND": "python", "QNPIPE_READ__VERIFY_CRC32": "1"})
    with SsdReader.from_config(cfg.read) as reader:
        assert reader.backend == ReadBackend.PYTHON and reader.statistics().backend == "python"


# ---------------------------------------------------------------------------- into MLX


def test_read_into_mlx_memory_without_a_copy(store) -> None:
    mx = pytest.importorskip("mlx.core")
    root, index = store
    lf = index.layers[1]
    arr, host = mlx_aligned_buffer(lf.record_nbytes)
    assert buffer_address(host) % ALIGN == 0 and host.nbytes == aligned_len(lf.record_nbytes)
    with SsdReader(workers=1) as reader:
        (res,) = reader.read_batch(requests_for(root, index, [(1, 6)], [host]))
    assert not res.bounced
    rec = expected(root, lf, 6)
    assert bytes(np.asarray(arr[: lf.record_nbytes])) == rec
    # A tensor of the record as an MLX view of the same memory (no copy).
    t = next(t for t in lf.tensors if t.name == "up_proj.weight")
    w = arr[t.offset : t.offset + t.nbytes].view(mx.uint32).reshape(t.shape)
    mx.eval(w)
    assert buffer_address(np.asarray(w)) == buffer_address(host) + t.offset
    np.testing.assert_array_equal(
        np.asarray(w), np.frombuffer(rec[t.offset : t.offset + t.nbytes], dtype=np.uint32).reshape(t.shape)
    )


@pytest.mark.skipif(not ssd.c_extension_available(), reason="C extension not built")
def test_c_and_python_runners_report_the_same_results(tmp_path) -> None:
    path = tmp_path / "f.bin"
    data = np.random.default_rng(5).integers(0, 256, 5 * 4096 + 10, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    bad_fd = os.open(path, os.O_RDONLY)
    os.close(bad_fd)
    try:
        specs = [  # offset, buffer sizes, need
            (0, (8192,), 8192), (4096, (4096,), 100), (4 * 4096, (8192,), 4096 + 10), (4 * 4096, (8192,), 8192),
            (10**6, (4096,), 1), (100, (10, 4096, 3), 4109), (5 * 4096 - 7, (4, 4), 8),
        ]
        results = {}
        for name, runner in (("c", ssd.CRunner(2)), ("py", ssd.PyRunner(2, os.preadv))):
            bufs = [tuple(bytearray(n) for n in sizes) for _, sizes, _ in specs]
            ops = [
                (fd, off, need, memoryview(bs[0]) if len(bs) == 1 else tuple(memoryview(b) for b in bs))
                for (off, _, need), bs in zip(specs, bufs, strict=True)
            ]
            ops.append((bad_fd, 0, 10, memoryview(bytearray(10))))
            results[name] = (runner.run(ops), [b"|".join(bytes(x) for x in bs) for bs in bufs])
            runner.close()
    finally:
        os.close(fd)
    assert results["c"] == results["py"]
    assert results["c"][0] == [8192, 4096, 4096 + 10, 4096 + 10, 0, 4109, 8, -errno.EBADF]
    assert results["c"][1][5] == b"|".join((data[100:110], data[110:4206], data[4206:4209]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_record_past_the_end_of_file_is_a_read_error(tmp_path, backend) -> None:
    path = tmp_path / "layer.bin"
    path.write_bytes(b"\7" * 3 * 4096)
    req = ReadRequest(path=str(path), offset=2 * 4096, nbytes=8192, buf=alloc_aligned(8192), layer=4, expert=9)
    with SsdReader(backend=backend) as reader:
        with pytest.raises(ReadError, match=r"expert 9 of layer 4: short read: 4096 of 8192 bytes"):
            reader.read_batch([req])
        s = reader.statistics()
    assert (s.retries, s.errors, s.reads) == (1, 1, 0)


# ---------------------------------------------------------------------------- scatter into slot arrays


def _pool(lf: LayerFile, slots: int) -> dict[str, np.ndarray]:
    """A pool layer as the model holds it: one stacked array per tensor, [slots, tensor bytes]."""
    return {t.name: alloc_aligned(slots * t.nbytes)[: slots * t.nbytes].reshape(slots, t.nbytes) for t in lf.tensors}


def _scatter_requests(root: Path, index: StoreIndex, keys: list[tuple[int, int]], pools, slots: list[int]):
    reqs = []
    for (layer, expert), slot in zip(keys, slots, strict=True):
        lf = index.layers[layer]
        dest = {name: stack[slot] for name, stack in pools[layer].items()}
        reqs.append(ReadRequest(
            path=str(root / "experts" / lf.file), offset=expert * lf.stride, nbytes=lf.record_nbytes,
            buf=scatter_buffers(lf.tensors, lf.record_nbytes, dest), layer=layer, expert=expert,
            crc32=lf.checksums[expert],
        ))
    return reqs


def _check_slots(root, index, keys, pools, slots) -> None:
    for (layer, expert), slot in zip(keys, slots, strict=True):
        lf = index.layers[layer]
        rec = expected(root, lf, expert)
        for t in lf.tensors:
            assert bytes(pools[layer][t.name][slot]) == rec[t.offset : t.offset + t.nbytes], (layer, expert, t.name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nocache", [True, False])
def test_scatter_a_record_into_slot_arrays_in_place(tmp_path, backend, nocache) -> None:
    index = write_store(tmp_path, layers=2, experts=6, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    pools = [_pool(lf, 4) for lf in index.layers]
    keys = [(0, 5), (1, 0), (0, 2), (1, 3), (0, 0)]
    slots = [3, 0, 1, 2, 0]
    with SsdReader(workers=2, backend=backend, nocache=nocache, verify_crc32=True) as reader:
        results = reader.read_batch(_scatter_requests(tmp_path, index, keys, pools, slots))
        stats = reader.statistics()
    _check_slots(tmp_path, index, keys, pools, slots)
    assert not any(r.bounced for r in results) and stats.bounced_reads == 0
    assert stats.verified_reads == len(keys) and stats.checksum_failures == 0


@pytest.mark.skipif(nocache_mode(True) is not CacheMode.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_scatter_is_one_aligned_preadv_per_record(tmp_path) -> None:
    index = write_store(tmp_path, layers=1, experts=3, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    pools = [_pool(index.layers[0], 2)]
    hook = Recorder()
    with SsdReader(workers=2, preadv=hook) as reader:
        reader.read_batch(_scatter_requests(tmp_path, index, [(0, 1), (0, 2)], pools, [1, 0]))
    assert len(hook.calls) == 2
    for _fd, offset, bufs in hook.calls:
        assert len(bufs) == 9 and offset % ALIGN == 0
        assert all(a % ALIGN == 0 and n % ALIGN == 0 for a, n in bufs)
    _check_slots(tmp_path, index, [(0, 1), (0, 2)], pools, [1, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_of_unaligned_tensors_bounces_once(store, backend) -> None:
    root, index = store  # the tiny 4-bit layout: 4096 + 256 + 256 byte tensors
    pools = [_pool(lf, 3) for lf in index.layers]
    keys = [(2, 7), (0, 1), (2, 0)]
    slots = [0, 2, 1]
    with SsdReader(workers=2, backend=backend) as reader:
        results = reader.read_batch(_scatter_requests(root, index, keys, pools, slots))
    _check_slots(root, index, keys, pools, slots)
    if nocache_mode(True) is CacheMode.O_DIRECT:
        assert all(r.bounced for r in results)


def test_scatter_buffers_fill_gaps_and_tail() -> None:
    tensors = (
        TensorSlot(name="a", dtype="uint8", shape=(100,), offset=0, nbytes=100),
        TensorSlot(name="b", dtype="uint8", shape=(50,), offset=128, nbytes=50),
    )
    dest = {"a": bytearray(100), "b": bytearray(60)}
    bufs = scatter_buffers(tensors, 178, dest)
    assert [memoryview(b).nbytes for b in bufs] == [100, 28, 50, ALIGN - 178]
    with pytest.raises(ValueError, match="holds 10 bytes"):
        scatter_buffers(tensors, 178, {"a": bytearray(10), "b": bytearray(60)})


def test_scatter_into_mlx_stacked_arrays_without_a_copy(tmp_path) -> None:
    mx = pytest.importorskip("mlx.core")
    index = write_store(tmp_path, layers=1, experts=5, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    lf = index.layers[0]
    slots = 3
    dtypes = {"uint32": (mx.uint32, np.uint32), "bfloat16": (mx.bfloat16, np.uint16)}
    stacks, hosts = {}, {}
    for t in lf.tensors:  # the pool's [slots, *shape] arrays, in memory MLX owns
        raw, host = mlx_aligned_buffer(slots * t.nbytes)
        stacks[t.name] = raw[: slots * t.nbytes].view(dtypes[t.dtype][0]).reshape(slots, *t.shape)
        hosts[t.name] = host[: slots * t.nbytes].reshape(slots, t.nbytes)
    keys, where = [(0, 4), (0, 1)], [2, 0]
    with SsdReader(workers=2) as reader:
        results = reader.read_batch(_scatter_requests(tmp_path, index, keys, [hosts], where))
    assert not any(r.bounced for r in results)
    for t in lf.tensors:  # the stacked arrays are views of the memory the reader wrote
        bits = stacks[t.name].view(mx.uint16) if t.dtype == "bfloat16" else stacks[t.name]  # numpy has no bf16
        mx.eval(bits)
        assert buffer_address(np.asarray(bits)) == buffer_address(hosts[t.name])
    for (_, expert), slot in zip(keys, where, strict=True):
        rec = expected(tmp_path, lf, expert)
        for t in lf.tensors:
            got = stacks[t.name][slot]
            if t.dtype == "bfloat16":
                got = got.view(mx.uint16)
            want = np.frombuffer(rec[t.offset : t.offset + t.nbytes], dtype=dtypes[t.dtype][1]).reshape(t.shape)
            np.testing.assert_array_equal(np.asarray(got), want)


# ---------------------------------------------------------------------------- a store from `qnpipe convert`


def test_reads_a_converted_store_via_record_location(tiny_qn4) -> None:
    from qnpipe.io.store import ExpertStore

    with ExpertStore.open(tiny_qn4) as store, SsdReader(workers=4, verify_crc32=True) as reader:
        keys = []
        for layer in store.layers:
            n = store.layer_file(layer).num_experts
            keys += [(layer, 0), (layer, n - 1), (layer, n // 2)]
        reqs, pools = [], {}
        for i, (layer, expert) in enumerate(keys):
            path, offset, nbytes = store.record_location(layer, expert)
            lf = store.layer_file(layer)
            buf = alloc_aligned(nbytes) if i % 2 else scatter_buffers(
                lf.tensors, nbytes, pools.setdefault((layer, expert), {t.name: bytearray(t.nbytes) for t in lf.tensors})
            )
            reqs.append(ReadRequest(path=str(path), offset=offset, nbytes=nbytes, buf=buf, layer=layer, expert=expert,
                                    crc32=lf.checksums[expert]))
        results = reader.read_batch(reqs)
        assert reader.statistics().verified_reads == len(keys)
        for i, ((layer, expert), req) in enumerate(zip(keys, reqs, strict=True)):
            want = store.read_record(layer, expert, verify=True)
            want_t = store.record_tensors(layer, want)
            if i % 2:
                assert bytes(req.buf[: req.nbytes]) == want
                got_t = store.record_tensors(layer, req.buf)
            else:
                got_t = {name: np.frombuffer(b, dtype=want_t[name].dtype).reshape(want_t[name].shape)
                         for name, b in pools[(layer, expert)].items()}
            assert got_t.keys() == want_t.keys()
            for name in want_t:
                np.testing.assert_array_equal(got_t[name], want_t[name])
        assert all(r.attempts == 1 for r in results)
