"""Streaming safetensors output for `qnpipe convert`: tensors planned up front, written as computed.

A `WriteJob` names its output tensors (`OutTensor`: name, dtype, shape) and yields their bytes; the
header is known from the plan, so `write_safetensors` writes it first and `pwrite`s each
piece at its offset, never holding a whole file in memory. `write_model_shards` splits the
non-expert weights into `model.safetensors` or mlx-lm style shards plus their index.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from qnpipe.errors import QnpipeError
from qnpipe.io.dtypes import ST_DTYPE_BYTES
from qnpipe.model.checkpoint import INDEX_FILE


@attrs.frozen
class OutTensor:
    name: str
    st_dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPE_BYTES[self.st_dtype]


@attrs.frozen
class WriteJob:
    """Output tensors computed together (a quantized weight gives weight, scales, biases)."""

    outs: tuple[OutTensor, ...]
    run: Callable[[], Iterator[tuple[int, int, np.ndarray]]]  # yields (output index, byte offset in it, data)


def _safetensors_header(outs: Sequence[OutTensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for o in outs:
        header[o.name] = {"dtype": o.st_dtype, "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    return len(h + b" " * (-len(h) % 8)).to_bytes(8, "little") + h + b" " * (-len(h) % 8)


def plan_shards(jobs: Sequence[WriteJob], max_bytes: int) -> list[list[WriteJob]]:
    shards: list[list[WriteJob]] = [[]]
    size = 0
    for j in jobs:
        n = sum(o.nbytes for o in j.outs)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(j)
        size += n
    return shards


def safetensors_nbytes(jobs: Sequence[WriteJob]) -> int:
    outs = [o for j in jobs for o in j.outs]
    return len(_safetensors_header(outs)) + sum(o.nbytes for o in outs)


def write_safetensors(path: Path, jobs: Sequence[WriteJob], advance: Callable[[int], None]) -> None:
    """Stream `jobs` into one safetensors file whose header is known from the plan."""
    outs = [o for j in jobs for o in j.outs]
    header = _safetensors_header(outs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        pos = len(header)
        for j in jobs:
            written = [0] * len(j.outs)
            starts = [pos + sum(o.nbytes for o in j.outs[:i]) for i in range(len(j.outs))]
            for i, off, a in j.run():
                data = np.ascontiguousarray(a)
                if data.dtype.itemsize != ST_DTYPE_BYTES[j.outs[i].st_dtype] or off + data.nbytes > j.outs[i].nbytes:
                    raise QnpipeError(f"internal error: {j.outs[i].name} came out {a.dtype}{list(a.shape)}, "
                                      f"planned {j.outs[i].st_dtype}{list(j.outs[i].shape)}")
                os.pwrite(fd, data.data, starts[i] + off)
                written[i] += data.nbytes
                advance(data.nbytes)
            for o, n in zip(j.outs, written, strict=True):
                if n != o.nbytes:
                    raise QnpipeError(f"internal error: {o.name}: {n} bytes written, {o.nbytes} planned")
            pos += sum(o.nbytes for o in j.outs)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model_shards(out: Path, jobs: Sequence[WriteJob], max_bytes: int, advance: Callable[[int], None]) -> None:
    """`model.safetensors`, or shards of at most `max_bytes` (a larger job gets one alone) and their index."""
    shards = plan_shards(jobs, max_bytes)
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0], advance)
        return
    wmap: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shard, advance)
        for o in (o for j in shard for o in j.outs):
            wmap[o.name] = name
            total += o.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")
