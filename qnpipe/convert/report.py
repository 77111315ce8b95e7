"""What a `qnpipe convert` returns (`ConvertReport`) and the model directory's format name and version."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MODEL_FORMAT", "MODEL_VERSION", "ConvertReport"]

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
