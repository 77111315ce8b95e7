"""Hand-built torch `.pt` files (no torch needed): FLAME captures with any tensor metadata, valid or hostile.

`capture(...)` is a valid one-layer FLAME capture (`token_position` 0, `n` sequences); every
tensor's storage offset, size, stride and announced element count can be overridden, so a test
can write exactly the file a hostile party would. `pickled` emits the pickle opcodes by hand,
as `torch.save` lays them out (protocol 2, `_rebuild_tensor_v2` over a persistent storage id).
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

STORAGES = {np.dtype(np.int64): "LongStorage", np.dtype(np.float32): "FloatStorage",
            np.dtype(np.int32): "IntStorage", np.dtype(np.uint8): "ByteStorage"}


class Tensor(NamedTuple):
    """One tensor of the pickle: its storage (`data`, stored under `key`) and how the tensor views it."""

    key: str
    data: np.ndarray  # the storage's elements (1-D)
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int  # the element count the persistent id announces


def _value(v: Any) -> bytes:
    """The opcodes that push `v` (a plain value), from pickle itself: its PROTO prefix and STOP cut off."""
    return pickle.dumps(v, protocol=2)[2:-1]


def _int(v: int) -> bytes:
    n = (v.bit_length() + 8) // 8 if v else 1
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)  # LONG1: any int, negative or huge


def _ints(vs: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_int(v) for v in vs) + b"t"  # MARK ... TUPLE


def _tensor(t: Tensor) -> bytes:
    storage = STORAGES[t.data.dtype]
    pid = (b"(" + _value("storage") + f"ctorch\n{storage}\n".encode() + _value(t.key) + _value("cpu")
           + _int(t.numel) + b"t")
    return (b"ctorch._utils\n_rebuild_tensor_v2\n" + b"(" + pid + b"Q" + _int(t.offset) + _ints(t.size)
            + _ints(t.stride) + b"\x89" + b"ccollections\nOrderedDict\n)R" + b"tR")


def pickled(meta: dict[str, Any], tensors: dict[str, Tensor]) -> bytes:
    """A protocol-2 pickle of the dict `meta | tensors`, laid out as torch.save lays it out."""
    body = b"".join(_value(k) + _value(v) for k, v in meta.items())
    body += b"".join(_value(k) + _tensor(t) for k, t in tensors.items())
    return b"\x80\x02}(" + body + b"u."


def write_pt(path: Path, meta: dict[str, Any], tensors: dict[str, Tensor],
             extra: dict[str, bytes] | None = None) -> Path:
    """`path` as a torch zip: `archive/data.pkl`, the storages under `archive/data/KEY`, and `extra` members."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickled(meta, tensors))
        z.writestr("archive/byteorder", b"little")
        for t in tensors.values():
            z.writestr(f"archive/data/{t.key}", t.data.astype(t.data.dtype.newbyteorder("<")).tobytes())
        for k, v in (extra or {}).items():
            z.writestr(f"archive/{k}", v)
    return path


def capture_tensors(n: int = 16, seed: int = 0) -> dict[str, Tensor]:
    """The three tensors of a valid capture of `n` sequences: distinct top-6 ids of 64 experts, their scores."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(64)[:6] for _ in range(n)]).astype(np.int64)
    scores = rng.random((n, 6)).astype(np.float32)
    samples = rng.integers(0, 50_000, n).astype(np.int64)
    return {"samples": Tensor("0", samples, 0, (n,), (1,), n),
            "scores": Tensor("1", scores.reshape(-1), 0, (n, 6), (6, 1), n * 6),
            "indices": Tensor("2", ids.reshape(-1), 0, (n, 6), (6, 1), n * 6)}


META = {"model": "flame-moe-290m", "layer": 2, "token_position": 0}


def capture(path: Path, n: int = 16, **indices: Any) -> Path:
    """A valid capture at `path`, its `indices` tensor's fields replaced by `indices` (offset=, stride=, ...)."""
    t = capture_tensors(n)
    t["indices"] = t["indices"]._replace(**indices)
    return write_pt(path, META, t)


def patch_sizes(path: Path, member: str, file_size: int) -> Path:
    """Rewrite the uncompressed size the zip declares for `member` (local header and central directory).

    Only 32-bit sizes (no zip64): enough to declare 4 GB against a few bytes of data.
    """
    data = bytearray(path.read_bytes())
    name = member.encode()
    local = data.find(b"PK\x03\x04")
    while local >= 0:
        nlen = struct.unpack_from("<H", data, local + 26)[0]
        if data[local + 30:local + 30 + nlen] == name:
            struct.pack_into("<I", data, local + 22, file_size)
        local = data.find(b"PK\x03\x04", local + 4)
    central = data.find(b"PK\x01\x02")
    while central >= 0:
        nlen = struct.unpack_from("<H", data, central + 28)[0]
        if data[central + 46:central + 46 + nlen] == name:
            struct.pack_into("<I", data, central + 24, file_size)
        central = data.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(data))
    return path
