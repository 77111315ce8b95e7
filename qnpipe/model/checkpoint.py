"""Reading Qwen3-Next checkpoints: safetensors headers, shard indexes, and the two layouts.

Layouts (docs/model.md, "Checkpoint layouts"): original Hugging Face (per-expert tensors, zero-centred norms,
conv1d `[C, 1, K]`, `mtp.*`) and mlx-lm converted (stacked `switch_mlp`, norms stored as
`1 + w`, conv1d `[C, K, 1]`, optionally affine-quantized). `to_mlx_names` turns the first
into the second exactly as mlx-lm's `sanitize` does, keeping `mtp.*` aside.
"""

from __future__ import annotations

import enum
import json
import os
import re
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from qnpipe.errors import CheckpointError
from qnpipe.io.dtypes import ST_DTYPE_BYTES, ST_NUMPY
from qnpipe.io.files import SMALL_CAP, check_regular, read_capped

INDEX_FILE = "model.safetensors.index.json"
NORM_SUFFIXES = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
    ".q_norm.weight", ".k_norm.weight",
)
# The safetensors format's own bound on its JSON header (safetensors' MAX_HEADER_SIZE): a file that
# claims more is refused before the header is read into memory.
MAX_HEADER_BYTES = 100_000_000
HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Layout(enum.StrEnum):
    HF = "hf"
    MLX = "mlx"
    QNPIPE = "qnpipe"  # `qnpipe convert` output: non-expert safetensors + experts/ store


@attrs.frozen
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the tensor's data in `file`
    nbytes: int = 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header against the file's size.

    Raises CheckpointError naming the file when it is truncated, its header is not
    valid JSON, or a tensor's byte range does not fit its dtype and shape.
    """
    size = check_regular(path, error=CheckpointError)
    try:
        # O_NONBLOCK: a FIFO swapped in after the check cannot block the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file: header says {n} header bytes, file has {size - 8}"
                )
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes; at most {MAX_HEADER_BYTES} "
                                      f"are read (the format's own limit)")
            raw = os.pread(fd, n, 8)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) != n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, int too long
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if not isinstance(dtype, str) or dtype not in ST_DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not all(type(v) is int and v >= 0 for v in (*shape, lo, hi)) or lo > hi:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r} "
                                  f"(shape {info['shape']!r}, data_offsets {info['data_offsets']!r})")
        nbytes = ST_DTYPE_BYTES[dtype]
        for d in shape:
            nbytes *= d
        if hi - lo != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {hi - lo} bytes for dtype {dtype} shape {list(shape)} ({nbytes} expected)"
            )
        if hi > data_len:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {hi} of the data, "
                f"file holds {data_len} data bytes"
            )
        out[name] = TensorInfo(path, dtype, shape, 8 + n + lo, nbytes)
    return out


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, via its shard index when there is one."""
    index = model_dir / INDEX_FILE
    if os.path.lexists(index):
        data = read_capped(index, SMALL_CAP, error=CheckpointError)
        try:
            wmap = json.loads(data)["weight_map"]
            names = set(wmap.values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise CheckpointError(f"{index}: not a valid shard index (needs a 'weight_map' object)") from None
        for name in sorted(names, key=str):
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
                raise CheckpointError(f"{index}: shard {name!r} must be a plain file name inside {model_dir}")
        files = sorted(model_dir / f for f in names)
        for f in files:
            if not os.path.lexists(f):
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model*.safetensors weight files")
    return files


def scan(model_dir: Path) -> dict[str, TensorInfo]:
    """Headers of every weight file: tensor name -> where it lives, its dtype and shape."""
    infos: dict[str, TensorInfo] = {}
    for f in weight_files(model_dir):
        for name, info in read_header(f).items():
            if name in infos:
                raise CheckpointError(f"tensor {name!r} appears in both {infos[name].file} and {f}")
            infos[name] = info
    return infos


def is_qnpipe_dir(model_dir: Path, config: dict[str, Any]) -> bool:
    """True for a `qnpipe convert` output: a `qnpipe` section in config.json or an `experts/index.json`."""
    # exists, not is_file: an index that is a FIFO or a directory is reported by the store, not taken for no store.
    return isinstance(config.get("qnpipe"), dict) or (Path(model_dir) / "experts" / "index.json").exists()


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's raw data with one pread, as numpy in its storage dtype (BF16 as uint16 bits).

    Raises CheckpointError naming the file when the read comes up short or the dtype is unknown.
    """
    np_dtype = ST_NUMPY.get(info.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{info.file}: unsupported tensor dtype {info.dtype}")
    try:
        fd = os.open(info.file, os.O_RDONLY)
        try:
            buf = os.pread(fd, info.nbytes, info.offset)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"{info.file}: cannot read ({e.strerror})") from None
    if len(buf) != info.nbytes:
        raise CheckpointError(
            f"{info.file}: truncated: {info.nbytes} bytes at offset {info.offset} expected, got {len(buf)}"
        )
    return np.frombuffer(buf, dtype=np_dtype).reshape(info.shape)


def detect_layout(infos: dict[str, TensorInfo], model_dir: Path) -> Layout:
    if any(HF_EXPERT.match(n) for n in infos):
        return Layout.HF
    if any(".mlp.switch_mlp." in n for n in infos):
        return Layout.MLX
    raise CheckpointError(
        f"{model_dir}: neither an original Hugging Face Qwen3-Next checkpoint (mlp.experts.N.*) "
        f"nor an mlx-lm converted one (mlp.switch_mlp.*)"
    )


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, mx.array]:
    """Every tensor of one safetensors file (``mx.load``, typed for that format)."""
    out = mx.load(os.fspath(path))
    assert isinstance(out, dict)  # mx.load returns a dict for a .safetensors file
    return out


def load_tensors(infos: dict[str, TensorInfo]) -> dict[str, mx.array]:
    """Load every tensor (headers already validated), naming the file on failure."""
    out: dict[str, mx.array] = {}
    for f in sorted({i.file for i in infos.values()}):
        try:
            out.update(load_safetensors(f))
        except Exception as e:  # mlx raises bare RuntimeError/ValueError for corrupt files
            raise CheckpointError(f"{f}: cannot load safetensors data ({e})") from None
    return out


def to_mlx_names(
    weights: dict[str, mx.array], num_experts: int, moe_layers: tuple[int, ...],
    tie_word_embeddings: bool, where: dict[str, TensorInfo],
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """HF layout -> mlx-lm layout (mlx-lm's `sanitize`); returns (main weights, mtp weights in HF form)."""
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    w = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    if tie_word_embeddings:
        w.pop("lm_head.weight", None)
    for layer in moe_layers:
        prefix = f"model.layers.{layer}.mlp"
        for proj in ("up_proj", "down_proj", "gate_proj"):
            names = [f"{prefix}.experts.{e}.{proj}.weight" for e in range(num_experts)]
            missing = [n for n in names if n not in w]
            if missing:
                raise CheckpointError(f"missing tensor {missing[0]} (layer {layer} has {num_experts} experts)")
            shapes = {w[n].shape for n in names}
            if len(shapes) != 1:
                bad = next(n for n in names if w[n].shape != w[names[0]].shape)
                raise CheckpointError(
                    f"{where[bad].file}: tensor {bad} has shape {list(w[bad].shape)}, "
                    f"expected {list(w[names[0]].shape)} like expert 0"
                )
            w[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([w.pop(n) for n in names])
    stray = [k for k in w if HF_EXPERT.match(k)]
    if stray:
        raise CheckpointError(f"{where[stray[0]].file}: unexpected tensor {stray[0]} (expert id out of range?)")
    for k, v in w.items():
        w[k] = sanitize_tensor(k, v)
    return w, mtp


def sanitize_tensor(name: str, a: mx.array) -> mx.array:
    """mlx-lm's per-tensor sanitize of an HF tensor: conv1d `[C, 1, K]` -> `[C, K, 1]`, norms `w` -> `1 + w`."""
    if "conv1d.weight" in name and a.shape[-1] != 1:
        a = a.moveaxis(2, 1)
    if any(name.endswith(s) for s in NORM_SUFFIXES) and a.ndim == 1:
        a = a + 1.0
    return a


def load_strict(model: Any, w: Mapping[str, mx.array], infos: dict[str, TensorInfo], model_dir: Path) -> None:
    """Every tensor the model has, each of its shape, and no other: else CheckpointError naming the file."""
    expected = dict(tree_flatten(model.parameters()))
    for name in sorted(w):
        if name not in expected:
            file = infos[name].file if name in infos else model_dir
            raise CheckpointError(f"{file}: unexpected tensor {name} (not part of this model's config)")
    for name, arr in expected.items():
        if name not in w:
            raise CheckpointError(f"{model_dir}: missing tensor {name}")
        if tuple(w[name].shape) != tuple(arr.shape):
            file = infos[name].file if name in infos else model_dir
            raise CheckpointError(f"{file}: tensor {name} has shape {list(w[name].shape)}, expected {list(arr.shape)}")
    model.load_weights(list(w.items()), strict=True)
