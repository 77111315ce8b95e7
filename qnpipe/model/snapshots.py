"""Snapshots of the whole model state after a prompt head, in memory and on disk (MLX thread only).

A `Snapshot` is every layer's cache at one point of a prefill: the attention layers' keys
and values up to the offset, the Gated DeltaNet layers' conv and recurrent state, and every
other cache kind mlx-lm's models make (rotating, chunked, arrays, cache lists: one
`LayerState` each, qnpipe.model.snapshot_kinds), and any cache kind that implements
`SnapshotState`, such as the quantized KV cache. Restoring
it gives a cache that computes exactly what the captured one would have: same arrays,
same offsets (qnpipe.live.prefix decides when to capture and resume). With MTP speculation the
list ends with the MTP layer's KV cache, whose rows at n pair hidden j with token j+1 for
j < n: that state also depends on token n, which the snapshot records as `next_token`.
On a rank of a pipeline-parallel ring the layers other ranks run have no cache there (None):
their entries are `REMOTE`, without arrays, and each rank keeps a snapshot of its own layers
(qnpipe.live.parallel.snap).

File format (`save` / `load`), little-endian:

    MAGIC (8 bytes) | header length (u64) | header (msgpack, `FileHeader`) | blob

The blob is every array's raw bytes in header order; the header has the format version,
the model fingerprint, the token ids' hash and count, the token after them when the state
depends on it (-1 when not), and the blob's crc32. A file of
another version or model, or one that does not check, raises SnapshotError naming it.
Every layer's kind is checked against the fixed table of kinds before a cache is built: a
file is data, and names no class to import. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgspec
import numpy as np

from qnpipe.errors import SnapshotError
from qnpipe.io.atomic import atomic_file
from qnpipe.model.snapshot_kinds import (
    REMOTE,
    LayerState,
    SnapshotState,
    check_kind,
    layer_cache,
    layer_state,
    register_kind,
)

# REMOTE, LayerState, SnapshotState and register_kind live in qnpipe.model.snapshot_kinds; callers import them from here.
__all__ = ["MAGIC", "REMOTE", "LayerState", "Snapshot", "SnapshotState", "arrays_digest", "capture",
           "engine_fingerprint", "experts_fingerprint", "file_digest", "load", "model_fingerprint", "register_kind",
           "restore", "save", "token_key"]

MAGIC = b"QNSNAP\x00\x01"
FORMAT_VERSION = 2  # 2: `next_token` in the header (MTP states)
_LEN = struct.Struct("<Q")
MAX_HEADER_BYTES = 16 << 20  # a header lists a few arrays per layer: kilobytes


class Snapshot(msgspec.Struct, frozen=True):
    """The model state after `n_tokens` tokens: one LayerState per layer; `next_token` >= 0 when the
    state also holds work on the token after them (the MTP layer's last row), which must then follow."""

    n_tokens: int
    layers: tuple[LayerState, ...]
    next_token: int = -1

    def follows(self, tokens: Sequence[int]) -> bool:
        """Whether this state is the one `tokens` (which start with the snapshot's tokens) reach there."""
        n = self.n_tokens
        return self.next_token < 0 or (n < len(tokens) and tokens[n] == self.next_token)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


def token_key(tokens: Sequence[int]) -> str:
    """sha256 (hex) of the token ids (as little-endian u32) and their count: the snapshot's key."""
    ids = np.asarray(list(tokens), dtype="<u4")
    return hashlib.sha256(_LEN.pack(len(ids)) + ids.tobytes()).hexdigest()


def capture(cache: Sequence[Any], n_tokens: int, next_token: int = -1) -> Snapshot:
    """A snapshot of `cache` (one entry per layer) after `n_tokens` tokens, evaluated; `next_token`
    when the state depends on the token after them (MTP rows)."""
    layers = [layer_state(c, i, n_tokens) for i, c in enumerate(cache)]
    mx.eval([s.arrays for s in layers])
    return Snapshot(n_tokens, tuple(layers), next_token)


def restore(snap: Snapshot) -> list[Any]:
    """A fresh cache list in the state of `snap` (the snapshot stays valid: nothing is shared to write into)."""
    return [layer_cache(s) for s in snap.layers]


_CHUNK = 64 << 20  # bytes per crc32 piece: big arrays and files are checksummed by several threads


def _crc_pieces(views: Sequence[Any]) -> list[int]:
    """zlib.crc32 of each buffer, in parallel (zlib releases the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(views) < 2:
        return [zlib.crc32(v) for v in views]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(views))) as pool:
        return list(pool.map(zlib.crc32, views))


def _array_pieces(a: Any) -> list[Any]:
    """Contiguous byte views of `a`, at most `_CHUNK` bytes each, sharing its memory (evaluated by the caller)."""
    flat = mx.contiguous(a).reshape(-1)
    if flat.dtype == mx.bool_:
        flat = flat.astype(mx.uint8)
    u = flat.view(mx.uint8)
    return [u[i:i + _CHUNK] for i in range(0, max(u.size, 1), _CHUNK)]


def arrays_digest(named: Sequence[tuple[str, Any]]) -> str:
    """sha256 (hex) of named arrays: each one's name, shape, dtype and the crc32s of all its bytes.

    Every byte counts (a fine-tune that changes one row of one matrix changes it), at the cost
    of one pass over the arrays in memory, on several threads.
    """
    arrays = [a for _, a in named]
    mx.eval(arrays)
    pieces = [_array_pieces(a) for a in arrays]
    mx.eval(pieces)
    crcs = iter(_crc_pieces([memoryview(v) for ps in pieces for v in ps]))
    h = hashlib.sha256()
    for (name, a), ps in zip(named, pieces, strict=True):
        h.update(f"{name}|{tuple(a.shape)}|{a.dtype}|".encode())
        h.update(np.array([next(crcs) for _ in ps], dtype="<u4").tobytes())
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a file's size and the crc32s of its pieces (read in parallel); SnapshotError naming it."""
    from qnpipe.io.files import check_regular

    size = check_regular(path, error=SnapshotError)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        def piece(off: int) -> int:
            data = os.pread(fd, min(_CHUNK, size - off), off)
            if len(data) != min(_CHUNK, size - off):
                raise SnapshotError(f"{path}: changed while it was read (short read at offset {off})")
            return zlib.crc32(data)

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            crcs = list(pool.map(piece, range(0, size, _CHUNK)))
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    return hashlib.sha256(_LEN.pack(size) + np.array(crcs, dtype="<u4").tobytes()).hexdigest()


def model_fingerprint(model: Any, extra: str = "") -> str:
    """sha256 (hex) naming the weights a state belongs to: every parameter's name, shape, dtype and
    contents (`arrays_digest`), plus `extra` (what else changes the numbers: see `engine_fingerprint`).

    The routed experts attached to the model are not its parameters: `engine_fingerprint` adds them.
    """
    from mlx.utils import tree_flatten

    params = sorted(cast(list[tuple[str, Any]], tree_flatten(model.parameters())), key=lambda kv: kv[0])
    return hashlib.sha256(f"{extra}|params={arrays_digest(params)}".encode()).hexdigest()


def _resident_arrays(experts: Any) -> list[tuple[str, Any]]:
    """The named arrays of a qnpipe.model.experts.ResidentExperts, with each projection's quantization in the name."""
    out: list[tuple[str, Any]] = []
    for layer, le in sorted(experts.layers.items()):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = getattr(le, proj)
            q = f"{p.bits}:{p.group_size}:{p.mode}"
            out += [(f"{layer}.{proj}.{part}[{q}]", a) for part, a in
                    (("weight", p.weight), ("scales", p.scales), ("biases", p.biases)) if a is not None]
    return out


def experts_fingerprint(core: Any) -> str:
    """What the routed experts add to an engine's fingerprint (a qnpipe.live.loaded.LoadedModel).

    A streamed store is named by its `index.json` as decoded: every record's crc32, the tensors'
    shapes, dtypes and offsets, the quantization, the model id. That is cheap (no read of the
    records) and differs for any two stores that differ in a byte of a record, short of a
    crc32 collision. Experts resident in memory (a checkpoint without a store, or `pool.eager_load`)
    are checksummed where they are; a streamed MTP layer's file is checksummed once, whole.
    """
    parts = []
    st = core.streaming
    if st is not None:
        parts.append("store=" + hashlib.sha256(msgspec.json.encode(st.store.index)).hexdigest())
        if st.mtp is not None:
            mtp_file = next(iter(st.mtp.infos.values())).file
            parts.append("mtp_file=" + file_digest(mtp_file))
    else:
        parts.append("resident=" + arrays_digest(_resident_arrays(core.runner.loaded.experts)))
    head = core.mtp
    if head is not None:
        from mlx.utils import tree_flatten

        params = sorted(cast(list[tuple[str, Any]], tree_flatten(head.parameters())), key=lambda kv: kv[0])
        parts.append("mtp_head=" + arrays_digest(params))
        resident = getattr(head.mlp, "_experts", None)
        if resident is not None and hasattr(resident, "layers"):
            parts.append("mtp_experts=" + arrays_digest(_resident_arrays(resident)))
    return "|".join(parts)


def engine_fingerprint(core: Any) -> str:
    """The fingerprint of an engine's states (a qnpipe.live.loaded.LoadedModel): everything that changes the numbers
    of a prefill. The dense weights' bytes, the routed experts (`experts_fingerprint`), the MTP head,
    the whole config.json (shape, norms' eps, rope, quantization), the KV-cache settings, the
    forward settings (the prefill chunk, a top-k override), the MTP settings and, on a rank of a
    ring, its layer range.

    Two models that differ in any of these never share a snapshot; the cost is one pass over the
    weights in memory, once per engine, when a snapshot is first read or written.
    """
    from qnpipe.model.args import model_id

    kv = msgspec.json.encode(core.cfg.kv).decode()
    fwd = msgspec.json.encode(core.cfg.forward).decode()
    config = hashlib.sha256(json.dumps(core.runner.loaded.config, sort_keys=True, default=str).encode()).hexdigest()
    # An MTP engine's states end with the MTP layer's cache (built from the hidden `mtp.hidden` names):
    # never resumed by an engine without one, nor the other way round.
    mtp = f"on:{core.cfg.mtp.hidden}" if core.mtp is not None else "off"
    # A rank's state is its own layers': never restored into another split of the model.
    stage = core.stage
    layers = "" if stage is None or stage.size == 1 else f"layers={stage.lo}-{stage.hi - 1}|"
    extra = (f"{model_id(core.args)}|config={config}|kv={kv}|forward={fwd}|mtp={mtp}|{layers}"
             f"{experts_fingerprint(core)}")
    return model_fingerprint(core.runner.loaded.model, extra=extra)


# --------------------------------------------------------------------------- files


class ArrayHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class LayerHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    offset: int
    arrays: tuple[ArrayHeader, ...]


class FileHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format_version: int
    fingerprint: str
    tokens_sha256: str
    n_tokens: int
    next_token: int
    layers: tuple[LayerHeader, ...]
    blob_bytes: int
    blob_crc32: int


_DTYPES: dict[str, Any] = {str(d): d for d in (
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
    mx.float16, mx.bfloat16, mx.float32)}
_UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _raw(a: Any) -> np.ndarray:
    """The bytes of `a` as a numpy unsigned array (numpy has no bfloat16)."""
    if a.dtype == mx.bool_:
        a = a.astype(mx.uint8)
    return np.array(a.view(_UINT_OF_SIZE[a.dtype.size]))


def save(path: str | os.PathLike[str], snap: Snapshot, key: str, fingerprint: str) -> int:
    """Write `snap` (the state after the tokens whose `token_key` is `key`) atomically; returns the bytes written."""
    path = Path(path)
    raws = [[_raw(a) for a in s.arrays] for s in snap.layers]
    crc = 0
    total = 0
    for layer in raws:
        for r in layer:
            crc = zlib.crc32(r.data, crc)
            total += r.nbytes
    header = FileHeader(
        format_version=FORMAT_VERSION, fingerprint=fingerprint, tokens_sha256=key, n_tokens=snap.n_tokens,
        next_token=snap.next_token, layers=tuple(LayerHeader(s.kind, s.offset, tuple(ArrayHeader(str(a.dtype), tuple(a.shape), r.nbytes)
                                                         for a, r in zip(s.arrays, layer, strict=True)))
                     for s, layer in zip(snap.layers, raws, strict=True)),
        blob_bytes=total, blob_crc32=crc)
    head = msgspec.msgpack.encode(header)
    with atomic_file(path) as f:
        f.write(MAGIC + _LEN.pack(len(head)) + head)
        for layer in raws:
            for r in layer:
                f.write(r.data)
    return len(MAGIC) + _LEN.size + len(head) + total


def _read_exactly(fd: int, n: int, offset: int, path: Path, what: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.pread(fd, min(n - len(data), 1 << 26), offset + len(data))
        if not chunk:
            raise SnapshotError(f"{path}: truncated {what} ({len(data)} of {n} bytes)")
        data += chunk
    return bytes(data)


def load(path: str | os.PathLike[str], key: str, fingerprint: str) -> Snapshot:
    """The snapshot in `path`; SnapshotError naming the file when it is not a valid snapshot of `key` for this model.

    The header is read and checked first (a file of another model or other tokens costs a few
    bytes, whatever its size), then the arrays, whose total must be what the file holds after it.
    A FIFO, a directory or a device is refused without being opened for reading.
    """
    from qnpipe.io.files import check_regular

    path = Path(path)
    size = check_regular(path, error=SnapshotError)
    pre = len(MAGIC) + _LEN.size
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotError(f"{path}: not a regular file")
        data = os.pread(fd, pre, 0)
        if len(data) < pre or data[:len(MAGIC)] != MAGIC:
            raise SnapshotError(f"{path}: not a qnpipe snapshot (bad magic)")
        (hlen,) = _LEN.unpack_from(data, len(MAGIC))
        if pre + hlen > size:
            raise SnapshotError(f"{path}: truncated header ({size} bytes, header needs {pre + hlen})")
        if hlen > MAX_HEADER_BYTES:
            raise SnapshotError(f"{path}: header of {hlen} bytes; at most {MAX_HEADER_BYTES} are read")
        head = _read_exactly(fd, hlen, pre, path, "header")
        try:
            h = msgspec.msgpack.decode(head, type=FileHeader)
        except msgspec.DecodeError as e:
            raise SnapshotError(f"{path}: corrupt header ({e})") from None
        if h.format_version != FORMAT_VERSION:
            raise SnapshotError(f"{path}: format version {h.format_version}, this qnpipe reads {FORMAT_VERSION}")
        if h.fingerprint != fingerprint:
            raise SnapshotError(f"{path}: made for another model or other kv.* / forward.* / mtp settings "
                                f"(fingerprint {h.fingerprint[:12]}, this model {fingerprint[:12]})")
        if h.tokens_sha256 != key:
            raise SnapshotError(f"{path}: holds the state of other tokens (key {h.tokens_sha256[:12]})")
        held = size - pre - hlen
        if held != h.blob_bytes:
            raise SnapshotError(f"{path}: {held} bytes of arrays, the header says {h.blob_bytes} (truncated?)")
        listed = sum(ah.nbytes for lh in h.layers for ah in lh.arrays)
        if listed != h.blob_bytes:
            raise SnapshotError(f"{path}: the arrays' sizes add up to {listed} bytes, the header says {h.blob_bytes}")
        blob = memoryview(_read_exactly(fd, held, pre + hlen, path, "arrays"))
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if zlib.crc32(blob) != h.blob_crc32:
        raise SnapshotError(f"{path}: crc32 mismatch (corrupt)")
    layers: list[LayerState] = []
    pos = 0
    for i, lh in enumerate(h.layers):
        arrays = []
        for ah in lh.arrays:
            dtype = _DTYPES.get(ah.dtype)
            if (dtype is None or any(d < 0 for d in ah.shape) or len(ah.shape) > 8
                    or ah.nbytes != math.prod(ah.shape) * dtype.size):
                raise SnapshotError(f"{path}: layer {i}: bad array {ah.dtype} {ah.shape} of {ah.nbytes} bytes")
            udt = np.dtype(f"<u{dtype.size}")
            raw = np.frombuffer(blob[pos:pos + ah.nbytes], dtype=udt).reshape(ah.shape)
            pos += ah.nbytes
            a = mx.array(raw).view(dtype) if dtype != mx.bool_ else mx.array(raw).astype(mx.bool_)
            arrays.append(a)
        if why := check_kind(lh.kind, len(arrays)):
            raise SnapshotError(f"{path}: layer {i}: {why}")
        layers.append(LayerState(lh.kind, tuple(arrays), lh.offset))
    mx.eval([s.arrays for s in layers])
    return Snapshot(h.n_tokens, tuple(layers), h.next_token)
