"""The on-disk expert store: `experts/index.json` and one record file per MoE layer.

Expert e of layer l is the byte range `[e * stride, e * stride + record_nbytes)` of
`experts/<file>`; every tensor of one expert (gate/up/down weight, scales, biases) lies
inside that range, so one read fetches it. Stride and record offsets are multiples of
`ALIGN` (4096) so reads can bypass the page cache (O_DIRECT / F_NOCACHE). Tensor offsets
inside a record are multiples of `TENSOR_ALIGN`. Byte-level description: docs/store-format.md.

Version 2 adds the `family` block (which mlx-lm model the experts belong to and where each
layer's switch is) and records of any switch's expert linears (`fc1.weight`, `gate_proj.bias`,
uint8 `scales` of mxfp4/nvfp4/mxfp8). Version 1 (Qwen3-Next, `gate/up/down_proj` of
`model.layers.L.mlp.switch_mlp`) has no block: `index_family` gives the implied one.
"""

from __future__ import annotations

from typing import Any

import msgspec

FORMAT = "qnpipe-expert-store"
VERSION = 2  # the newest version; an index without a family block is version 1
READ_VERSIONS = (1, 2)
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
ALIGN = 4096
TENSOR_ALIGN = 64
INDEX_FILE = "index.json"


def aligned_len(nbytes: int, align: int = ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


class TensorSlot(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of an expert record: `name` like "gate_proj.weight"; `shape` is per expert."""

    name: str
    dtype: str  # numpy/mlx dtype name: "uint32", "uint8", "bfloat16", "float16", "float32"
    shape: tuple[int, ...]
    offset: int  # from the start of the record
    nbytes: int


class Quant(msgspec.Struct, frozen=True, kw_only=True):
    """Quantization of one expert linear (None in LayerFile = float weights).

    `mode` is mlx's: affine (float scales and biases), mxfp4, nvfp4, mxfp8 (uint8 scales, no
    biases); `global_scale` is true when the linear has nvfp4's per-expert `global_scale` tensor.
    """

    bits: int
    group_size: int
    mode: str = "affine"
    global_scale: bool = False  # written only when true: a version 1 index has no such key

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
    quant: dict[str, Quant] | None  # per expert linear ("gate_proj", "fc1", ...); None = float
    checksums: tuple[int, ...]  # zlib.crc32 of each record's first record_nbytes bytes


class Family(msgspec.Struct, frozen=True, kw_only=True):
    """Which mlx-lm model a store's experts belong to (index version 2)."""

    model_type: str  # config.json's, e.g. "gpt_oss", "qwen3_5_moe"
    switch_class: str  # "SwitchGLU" or "SwitchMLP" (mlx_lm.models.switch_layers)
    switch_paths: dict[int, str]  # layer -> module path of its switch, e.g. "model.layers.3.mlp.experts"


class StoreIndex(msgspec.Struct, frozen=True, kw_only=True):
    """`experts/index.json`. Version 2 has a `family`; version 1 (Qwen3-Next) has none."""

    format: str = FORMAT
    version: int = 1
    model_id: str  # version 1: sha256 of the model's shape keys; 2: of the skeleton's tensors
    align: int = ALIGN
    checksum: str = "crc32"
    layers: tuple[LayerFile, ...]
    family: Family | None = None  # written only in version 2


# What a version 1 index implies: qnpipe's Qwen3-Next, a SwitchGLU per MoE layer.
V1_MODEL_TYPE = "qwen3_next"
V1_SWITCH_CLASS = "SwitchGLU"


def v1_switch_path(layer: int) -> str:
    return f"model.layers.{layer}.mlp.switch_mlp"


def index_family(index: StoreIndex) -> Family:
    """The index's family block, or the one a version 1 index implies."""
    if index.family is not None:
        return index.family
    return Family(model_type=V1_MODEL_TYPE, switch_class=V1_SWITCH_CLASS,
                  switch_paths={lf.layer: v1_switch_path(lf.layer) for lf in index.layers})


def quant_dict(q: Quant) -> dict[str, Any]:
    """`q` as JSON-ready builtins, `global_scale` only when true (as version 1 wrote a Quant)."""
    out = msgspec.to_builtins(q)
    if not q.global_scale:
        out.pop("global_scale")
    return out


def encode_index(index: StoreIndex) -> dict[str, Any]:
    """`index` as JSON-ready builtins; the keys a version 1 index never had (`family`, a false
    `global_scale`) are left out, so today's Qwen3-Next stores come out byte for byte as before."""
    out = msgspec.to_builtins(index)
    if out.get("family") is None:
        out.pop("family", None)
    for lf in out["layers"]:
        for q in (lf.get("quant") or {}).values():
            if not q.get("global_scale"):
                q.pop("global_scale", None)
    return out
