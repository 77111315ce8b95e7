"""The expert-layer writer every convert shares: records of one MoE layer, chunk by chunk, into its file.

A layer's experts come from a `read_chunk(e0, e1)` that gives each record tensor stacked
`[e1 - e0, ...]` (a transform of an HF or mlx-lm source, or plain slices of mlx-lm's contiguous
`[E, ...]` stacks); each record is laid out by `store.record_layout`, its crc32 taken, and the
chunk written with one pwrite. Memory stays near one chunk of source bytes.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from qnpipe.errors import QnpipeError
from qnpipe.io import store as st
from qnpipe.io.dtypes import NP_DTYPES
from qnpipe.io.store_format import LayerFile, Quant

__all__ = ["write_expert_layer"]


def write_expert_layer(experts_dir: Path, layer: int, read_chunk: Callable[[int, int], dict[str, np.ndarray]],
                       tensors: Sequence[tuple[str, str, tuple[int, ...]]], quant: dict[str, Quant] | None,
                       num_experts: int, src_bytes_per_expert: int, advance: Callable[[int], None],
                       chunk_bytes: int) -> LayerFile:
    """Write `experts_dir/layer_LLL.bin` (records of `tensors`, in that order) and return its LayerFile."""
    slots, record_nbytes, stride = st.record_layout(tensors)
    fname = st.layer_file_name(layer)
    crcs: list[int] = []
    per_chunk = max(1, min(num_experts, chunk_bytes // max(1, src_bytes_per_expert)))
    fd = os.open(experts_dir / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
    try:
        for e0 in range(0, num_experts, per_chunk):
            e1 = min(num_experts, e0 + per_chunk)
            arrays = read_chunk(e0, e1)
            buf = np.zeros((e1 - e0, stride), dtype=np.uint8)
            for s in slots:
                a = arrays[s.name]
                if a.shape[1:] != s.shape or a.dtype != np.dtype(NP_DTYPES[s.dtype]):
                    raise QnpipeError(f"internal error: layer {layer} {s.name} came out {a.dtype}{list(a.shape)}")
                buf[:, s.offset:s.offset + s.nbytes] = np.ascontiguousarray(a).reshape(e1 - e0, -1).view(np.uint8)
            crcs += [zlib.crc32(buf[i, :record_nbytes].data) for i in range(e1 - e0)]
            os.pwrite(fd, buf.data, e0 * stride)
            advance((e1 - e0) * stride)
            del arrays, buf
        os.fsync(fd)
    finally:
        os.close(fd)
    return LayerFile(layer=layer, file=fname, num_experts=num_experts, stride=stride, record_nbytes=record_nbytes,
                     file_nbytes=num_experts * stride, tensors=slots, quant=quant, checksums=tuple(crcs))
