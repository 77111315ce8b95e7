"""Access to the expert store of a qnpipe model directory (`experts/`; layout in docs/store-format.md).

`ExpertStore.open` validates `experts/index.json` (format, version, model id, record geometry)
and every layer file's size before anything is read, so a truncated or foreign store fails at
open. After that it answers where a record lives (`record_location`, for the fast reader),
reads one synchronously (`read_record`, optionally checking its crc32), and turns a record
buffer into numpy views of its tensors (`record_tensors`, no copy).
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from qnpipe.errors import StoreError
from qnpipe.io.dtypes import NP_DTYPES
from qnpipe.io.files import MiB, read_capped
from qnpipe.io.store_format import (
    ALIGN,
    FORMAT,
    INDEX_FILE,
    QUANT_MODES,
    READ_VERSIONS,
    TENSOR_ALIGN,
    LayerFile,
    StoreIndex,
    TensorSlot,
    aligned_len,
    encode_index,
)

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "EXPERTS_DIR", "ExpertStore", "as_mx", "layer_file_name",
    "read_index", "read_index_sha256", "record_layout", "write_index",
]

EXPERTS_DIR = "experts"

# Bounds of what an index may claim, checked before anything is sized from it: far above any real
# store (the 80B: 48 layers x 512 experts of ~1.7 MB records, an index of ~3 MB) and far below
# what would exhaust memory (the slots, verify-store's report and the index itself scale with them).
INDEX_CAP = 64 * MiB
MAX_ALIGN = 1 << 20
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_RECORDS = 1 << 20  # in all layers together
MAX_RECORD_BYTES = 1 << 30
MAX_TENSORS = 64


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:03d}.bin"


def record_layout(tensors: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[TensorSlot, ...], int, int]:
    """Place one expert's tensors `(name, dtype, shape)` in a record, in the given order.

    Each tensor starts at a multiple of TENSOR_ALIGN; returns (slots, record_nbytes, stride)
    with stride = record_nbytes rounded up to ALIGN.
    """
    slots = []
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * np.dtype(NP_DTYPES[dtype]).itemsize
        offset = aligned_len(offset, TENSOR_ALIGN)
        slots.append(TensorSlot(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes))
        offset += nbytes
    return tuple(slots), offset, aligned_len(max(offset, 1), ALIGN)


def write_index(experts_dir: Path, index: StoreIndex) -> Path:
    """Write `experts_dir/index.json` (indented JSON; `store_format.encode_index`); returns its path."""
    path = Path(experts_dir) / INDEX_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(encode_index(index)), indent=1) + b"\n")
    return path


def _experts_dir(path: str | os.PathLike[str]) -> Path:
    """`path` itself when it is the experts directory, else `path/experts`."""
    p = Path(path)
    if os.path.lexists(p / INDEX_FILE) or (p.name == EXPERTS_DIR and not (p / EXPERTS_DIR).is_dir()):
        return p
    return p / EXPERTS_DIR


def _check_layer(lf: LayerFile, index_path: Path, align: int) -> None:
    def bad(what: str) -> StoreError:
        return StoreError(f"{index_path}: layer {lf.layer} ({lf.file}): {what}")

    if not lf.file or "/" in lf.file or "\\" in lf.file or lf.file.startswith("."):
        raise bad(f"file name {lf.file!r} must be a plain name inside the experts directory")
    if not 0 <= lf.layer < MAX_LAYERS:
        raise bad(f"layer id {lf.layer} must be in 0..{MAX_LAYERS - 1}")
    if lf.num_experts < 1 or lf.record_nbytes < 1:
        raise bad(f"num_experts {lf.num_experts} and record_nbytes {lf.record_nbytes} must be positive")
    # Before the sizes are compared with the file's: slots are sized from these, so a sparse file
    # of a terabyte must not make them so.
    if lf.num_experts > MAX_EXPERTS:
        raise bad(f"num_experts {lf.num_experts}; at most {MAX_EXPERTS}")
    if lf.record_nbytes > MAX_RECORD_BYTES:
        raise bad(f"record_nbytes {lf.record_nbytes}; at most {MAX_RECORD_BYTES} bytes a record")
    if len(lf.tensors) > MAX_TENSORS:
        raise bad(f"{len(lf.tensors)} tensors a record; at most {MAX_TENSORS}")
    if lf.stride % align or lf.stride < lf.record_nbytes:
        raise bad(f"stride {lf.stride} must be a multiple of {align} and >= record_nbytes {lf.record_nbytes}")
    # Writers pad the last record to `stride` (qnpipe convert does); an unpadded last record is valid too.
    lo, hi = (lf.num_experts - 1) * lf.stride + lf.record_nbytes, lf.num_experts * lf.stride
    if not lo <= lf.file_nbytes <= hi:
        raise bad(f"file_nbytes {lf.file_nbytes} must be in [{lo}, {hi}] for {lf.num_experts} records "
                  f"of {lf.record_nbytes} bytes, {lf.stride} apart")
    for name, q in (lf.quant or {}).items():
        if q.mode not in QUANT_MODES:
            raise bad(f"{name} has quantization mode {q.mode!r} (known: {', '.join(QUANT_MODES)})")
    if len(lf.checksums) != lf.num_experts:
        raise bad(f"{len(lf.checksums)} checksums for {lf.num_experts} experts")
    for t in lf.tensors:
        if len(t.shape) > 8 or any(d < 0 for d in t.shape):
            raise bad(f"tensor {t.name} has shape {list(t.shape)} (at most 8 dimensions, none negative)")
        if t.dtype not in NP_DTYPES:
            raise bad(f"tensor {t.name} has unknown dtype {t.dtype!r} (known: {', '.join(NP_DTYPES)})")
        want = math.prod(t.shape) * np.dtype(NP_DTYPES[t.dtype]).itemsize
        if t.nbytes != want or t.offset < 0 or t.offset % TENSOR_ALIGN or t.offset + t.nbytes > lf.record_nbytes:
            raise bad(
                f"tensor {t.name} ({t.dtype} {list(t.shape)}, {t.nbytes} bytes at offset {t.offset}) does not fit "
                f"the record ({lf.record_nbytes} bytes; {want} bytes expected, offsets multiples of {TENSOR_ALIGN})"
            )


def _check_family(index: StoreIndex, index_path: Path) -> None:
    """Version 2 names the switch of every layer it stores; version 1 has no family block."""
    fam = index.family
    if index.version == 1:
        if fam is not None:
            raise StoreError(f"{index_path}: a version 1 index has no `family` block (version 2 has)")
        return
    if fam is None:
        raise StoreError(f"{index_path}: a version 2 index needs a `family` block (model_type, switch_class, "
                         f"switch_paths)")
    if fam.switch_class not in ("SwitchGLU", "SwitchMLP"):
        raise StoreError(f"{index_path}: family switch_class {fam.switch_class!r}; expected SwitchGLU or SwitchMLP")
    have, named = sorted(lf.layer for lf in index.layers), sorted(fam.switch_paths)
    if have != named:
        raise StoreError(f"{index_path}: family switch_paths name layers {named}, the index stores layers {have}")


def read_index(path: str | os.PathLike[str], *, expected_model_id: str | None = None) -> tuple[Path, StoreIndex]:
    """Decode and check `index.json` of a model or experts directory; returns (experts dir, index).

    Checks format, version, model id (when `expected_model_id` is given) and each layer's
    record geometry, but not the layer files (see `ExpertStore.open`). Raises StoreError
    naming the index file.
    """
    root, index, _ = read_index_sha256(path, expected_model_id=expected_model_id)
    return root, index


def read_index_sha256(path: str | os.PathLike[str], *,
                      expected_model_id: str | None = None) -> tuple[Path, StoreIndex, str]:
    """As `read_index`, and the sha256 (hex) of the file's bytes: what names the store
    (`store_check.check_store_sha256`)."""
    root = _experts_dir(path)
    index_path = root / INDEX_FILE
    if not os.path.lexists(index_path):
        raise StoreError(f"{index_path}: missing expert store index (is {path} a `qnpipe convert` output?)")
    raw = read_capped(index_path, INDEX_CAP, error=StoreError)
    try:
        head = msgspec.json.decode(raw, type=dict[str, Any])
    except msgspec.DecodeError as e:
        raise StoreError(f"{index_path}: not valid JSON ({e})") from None
    if head.get("format") != FORMAT:
        raise StoreError(f"{index_path}: format is {head.get('format')!r}, expected {FORMAT!r}")
    if head.get("version") not in READ_VERSIONS:
        raise StoreError(
            f"{index_path}: store format version {head.get('version')!r}; this qnpipe reads version "
            f"{' or '.join(map(str, READ_VERSIONS))} (re-run `qnpipe convert`)"
        )
    try:
        index = msgspec.convert(head, StoreIndex, str_keys=True)
    except msgspec.ValidationError as e:
        raise StoreError(f"{index_path}: invalid index ({e})") from None
    _check_family(index, index_path)
    if expected_model_id is not None and index.model_id != expected_model_id:
        raise StoreError(
            f"{index_path}: expert store belongs to another model (model_id {index.model_id[:16]}..., "
            f"this model's config.json gives {expected_model_id[:16]}...)"
        )
    if index.checksum != "crc32":
        raise StoreError(f"{index_path}: unknown checksum {index.checksum!r} (expected 'crc32')")
    if not 512 <= index.align <= MAX_ALIGN or index.align & (index.align - 1):
        raise StoreError(f"{index_path}: align {index.align} must be a power of two in 512..{MAX_ALIGN}")
    if len(index.layers) > MAX_LAYERS:
        raise StoreError(f"{index_path}: {len(index.layers)} layers; at most {MAX_LAYERS} are read")
    seen: set[int] = set()
    for lf in index.layers:
        if lf.layer in seen:
            raise StoreError(f"{index_path}: layer {lf.layer} listed twice")
        seen.add(lf.layer)
        _check_layer(lf, index_path, index.align)
    total = sum(lf.num_experts for lf in index.layers)
    if total > MAX_RECORDS:
        raise StoreError(f"{index_path}: {total} expert records in all; at most {MAX_RECORDS} are read")
    return root, index, hashlib.sha256(raw).hexdigest()


def as_mx(a: np.ndarray, dtype: str) -> mx.array:
    """An mx.array (a copy) of a record tensor view, with the index's `dtype` (bfloat16 restored from bits)."""
    import mlx.core as mx

    out = mx.array(np.ascontiguousarray(a))
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


class ExpertStore:
    """An open, validated expert store. Use `ExpertStore.open`; close it (or use `with`) when done."""

    def __init__(self, root: Path, index: StoreIndex, fds: dict[int, int], sha256: str = "") -> None:
        self.root = root
        self.index = index
        self.sha256 = sha256  # of index.json's bytes: the store's name (docs/store-format.md)
        self._layers = {lf.layer: lf for lf in index.layers}
        self._fds = fds

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, expected_model_id: str | None = None) -> ExpertStore:
        """Open the store of a model directory or of its `experts/` directory.

        Validates the index (`read_index`) and that every layer file is a regular file with
        exactly the size the index gives (`store_check.open_layer_file`; a FIFO or directory is
        refused without blocking). Raises StoreError naming the file (and the expected and
        actual sizes for a truncated or oversized one).
        """
        root, index, sha256 = read_index_sha256(path, expected_model_id=expected_model_id)
        from qnpipe.io.store_check import open_layer_file

        fds: dict[int, int] = {}
        try:
            for lf in index.layers:
                fds[lf.layer] = open_layer_file(root, lf)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(root, index, fds, sha256)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def layers(self) -> tuple[int, ...]:
        """The MoE layers in the store, ascending."""
        return tuple(sorted(self._layers))

    def layer_file(self, layer: int) -> LayerFile:
        try:
            return self._layers[layer]
        except KeyError:
            raise StoreError(f"{self.root / INDEX_FILE}: no layer {layer} in this store "
                             f"(layers {list(self.layers)})") from None

    def _check_expert(self, lf: LayerFile, expert: int) -> None:
        if not 0 <= expert < lf.num_experts:
            raise StoreError(f"{self.root / lf.file}: expert {expert} out of range (layer {lf.layer} "
                             f"has {lf.num_experts})")

    def record_location(self, layer: int, expert: int) -> tuple[Path, int, int]:
        """(file path, byte offset, record_nbytes) of one expert's record.

        The offset is a multiple of the index's `align`. Rounding the length up to `align`
        stays inside the file when the last record is padded to `stride` (qnpipe convert
        pads; a store whose `file_nbytes` stops at the last record's end needs a short
        final read there).
        """
        lf = self.layer_file(layer)
        self._check_expert(lf, expert)
        return self.root / lf.file, expert * lf.stride, lf.record_nbytes

    def _fd(self, layer: int) -> int:
        if layer not in self._fds:
            raise StoreError(f"{self.root}: store is closed")
        return self._fds[layer]

    def read_record(self, layer: int, expert: int, *, verify: bool = False) -> bytes:
        """Read one record with os.pread; with `verify`, check its crc32 against the index.

        Raises StoreError naming layer, expert, file and offset on a short read or a bad checksum.
        """
        path, offset, nbytes = self.record_location(layer, expert)
        try:
            buf = os.pread(self._fd(layer), nbytes, offset)
        except OSError as e:
            raise StoreError(f"{path}: cannot read layer {layer} expert {expert} at offset {offset} "
                             f"({e.strerror})") from None
        if len(buf) != nbytes:
            raise StoreError(f"{path}: short read of layer {layer} expert {expert} at offset {offset}: "
                             f"{len(buf)} of {nbytes} bytes")
        if verify:
            want = self._layers[layer].checksums[expert]
            got = zlib.crc32(buf)
            if got != want:
                raise StoreError(
                    f"{path}: checksum mismatch for layer {layer} expert {expert} at offset {offset} "
                    f"({nbytes} bytes): crc32 {got:08x}, index says {want:08x}"
                )
        return buf

    def record_tensors(self, layer: int, buf: Any) -> dict[str, np.ndarray]:
        """Numpy views (no copy) of the tensors in record buffer `buf` of `layer`.

        `buf` is any buffer of at least `record_nbytes` bytes (bytes, bytearray, memoryview,
        numpy uint8 array) holding one record from its first byte. Names are like
        "gate_proj.weight"; shapes are per expert; bfloat16 tensors come as uint16 bits (see `as_mx`).
        """
        lf = self.layer_file(layer)
        size = memoryview(buf).nbytes
        if size < lf.record_nbytes:
            raise ValueError(f"record buffer of layer {layer} has {size} bytes, needs {lf.record_nbytes}")
        return {
            t.name: np.frombuffer(buf, dtype=NP_DTYPES[t.dtype], count=math.prod(t.shape), offset=t.offset)
            .reshape(t.shape)
            for t in lf.tensors
        }

    def read_layer(self, layer: int, *, verify: bool = False) -> dict[str, np.ndarray]:
        """Every record of `layer` with one read: name -> strided view `[num_experts, *shape]`.

        With `verify`, every record's crc32 is checked first (StoreError names the first bad one).
        """
        lf = self.layer_file(layer)
        path = self.root / lf.file
        buf = np.empty(lf.file_nbytes, dtype=np.uint8)
        try:
            n = os.preadv(self._fd(layer), [buf.data], 0)
        except OSError as e:
            raise StoreError(f"{path}: cannot read layer {layer} ({e.strerror})") from None
        if n != lf.file_nbytes:
            raise StoreError(f"{path}: short read of layer {layer}: {n} of {lf.file_nbytes} bytes")
        if verify:
            for e in range(lf.num_experts):
                rec = buf[e * lf.stride: e * lf.stride + lf.record_nbytes]
                if (got := zlib.crc32(rec.data)) != lf.checksums[e]:
                    raise StoreError(
                        f"{path}: checksum mismatch for layer {layer} expert {e} at offset {e * lf.stride} "
                        f"({lf.record_nbytes} bytes): crc32 {got:08x}, index says {lf.checksums[e]:08x}"
                    )
        out = {}
        for t in lf.tensors:
            dt = np.dtype(NP_DTYPES[t.dtype])
            inner = tuple(int(np.prod(t.shape[i + 1:], dtype=np.int64)) * dt.itemsize for i in range(len(t.shape)))
            out[t.name] = np.ndarray((lf.num_experts, *t.shape), dtype=dt, buffer=buf, offset=t.offset,
                                     strides=(lf.stride, *inner))
        return out
