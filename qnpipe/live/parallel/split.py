"""Which decoder layers each rank runs, under its old path: it is qnpipe.plan.layer_split (pure,
below both the memory account's rank split in qnpipe.plan.ranks and the ring's join)."""

from __future__ import annotations

from qnpipe.plan.layer_split import model_layer_bytes, split_layers, tensor_bytes

__all__ = ["model_layer_bytes", "split_layers", "tensor_bytes"]
