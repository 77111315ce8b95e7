"""The on-disk expert store: `experts/index.json` and one record file per MoE layer.

Expert e of layer l is the byte range `[e * stride, e * stride + record_nbytes)` of
`experts/<file>`; every tensor of one expert (gate/up/down weight, scales, biases) lies
inside that range, so one read fetches it. Stride and record offsets are multiples of
`ALIGN` (4096) so reads can bypass the page cache (O_DIRECT / F_NOCACHE). Tensor offsets
inside a record are multiples of `TENSOR_ALIGN`. Byte-level description: docs/store-format.md.
"""

from __future__ import annotations

import msgspec

FORMAT = "qnpipe-expert-store"
VERSION = 1
ALIGN = 4096
TENSOR_ALIGN = 64
INDEX_FILE = "index.json"


def aligned_len(nbytes: int, align: int = ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


class TensorSlot(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of an expert record: `name` like "gate_proj.weight"; `shape` is per expert."""

    name: str
    dtype: str  # numpy/mlx dtype name: "uint32", "bfloat16", "float16", "float32"
    shape: tuple[int, ...]
    offset: int  # from the start of the record
    nbytes: int


class Quant(msgspec.Struct, frozen=True, kw_only=True):
    """Affine quantization of a layer's expert projections (None in LayerFile = float weights)."""

    bits: int
    group_size: int
    mode: str = "affine"

    def shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(packed weight, scales = biases) shapes of a float weight of `shape` quantized this way."""
        # The one home of the packing rule: `bits`-bit values, 32 / bits of them per uint32 along the input dim.
        return (*shape[:-1], shape[-1] * self.bits // 32), (*shape[:-1], shape[-1] // self.group_size)


class LayerFile(msgspec.Struct, frozen=True, kw_only=True):
    """One MoE layer's experts: a file of `num_experts` records, `stride` bytes apart."""

    layer: int
    file: str  # relative to the experts/ directory, e.g. "layer_003.bin"
    num_experts: int
    stride: int
    record_nbytes: int
    file_nbytes: int
    tensors: tuple[TensorSlot, ...]
    quant: dict[str, Quant] | None  # per projection ("gate_proj", "up_proj", "down_proj"); None = float
    checksums: tuple[int, ...]  # zlib.crc32 of each record's first record_nbytes bytes


class StoreIndex(msgspec.Struct, frozen=True, kw_only=True):
    """`experts/index.json`."""

    format: str = FORMAT
    version: int = VERSION
    model_id: str  # sha256 of the model's shape keys; a store from another model is refused
    align: int = ALIGN
    checksum: str = "crc32"
    layers: tuple[LayerFile, ...]
