"""What a `qnpipe convert` returns (`ConvertReport`) and the model directory's format name and version."""

from __future__ import annotations

from typing import Any

import msgspec

from qnpipe.io.store import EXPERTS_DIR
from qnpipe.io.store_format import ALIGN, FORMAT, StoreIndex

__all__ = ["MODEL_FORMAT", "MODEL_VERSION", "ConvertReport", "experts_section"]

MODEL_FORMAT = "qnpipe-model"
MODEL_VERSION = 1


class ConvertReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `convert` did. Sizes in bytes, times in seconds."""

    out: str
    source_layout: str
    moe_layers: int
    num_experts: int
    quantization: dict[str, Any] | None  # of the experts; None = float
    dtype: str | None
    mtp: bool
    bytes_written: int
    expert_bytes: int
    seconds: float
    bytes_per_s: float
    peak_rss_bytes: int
    warnings: tuple[str, ...] = ()


def experts_section(index: StoreIndex, index_sha256: str) -> dict[str, Any]:
    """config.json's `qnpipe.experts`: where the store is and what its records hold (docs/store-format.md).
    `index_sha256` names the store of this model, not only of its shape (qnpipe.model.args.store_sha256)."""
    lf = index.layers[0]
    return {
        "dir": EXPERTS_DIR,
        "index": f"{EXPERTS_DIR}/index.json",
        "store_format": FORMAT,
        "store_version": index.version,
        "model_id": index.model_id,
        "index_sha256": index_sha256,
        "align": ALIGN,
        "layers": [x.layer for x in index.layers],
        "num_experts": lf.num_experts,
        "stride": lf.stride,
        "record_nbytes": lf.record_nbytes,
        "record": [msgspec.to_builtins(t) for t in lf.tensors],
    }
