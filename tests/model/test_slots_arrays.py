"""Slot arrays by record tensor name, for any family's records (uint8 scales, biases); the native view only on
native Qwen3-Next layers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.io import store as st
from qnpipe.io.store_format import LayerFile, Quant
from qnpipe.model.slots import is_native_layer, make_layer_slots


def _layer(tensors: list[tuple[str, str, tuple[int, ...]]], quant: dict[str, Quant] | None) -> LayerFile:
    slots, nbytes, stride = st.record_layout(tensors)
    return LayerFile(layer=2, file="layer_002.bin", num_experts=8, stride=stride, record_nbytes=nbytes,
                     file_nbytes=8 * stride, tensors=slots, quant=quant, checksums=(0,) * 8)


def test_gpt_oss_records_get_typed_arrays_by_name_and_no_native_view() -> None:
    q = Quant(bits=4, group_size=32, mode="mxfp4")
    lf = _layer([("gate_proj.weight", "uint32", (16, 8)), ("gate_proj.scales", "uint8", (16, 2)),
                 ("gate_proj.bias", "bfloat16", (16,)), ("up_proj.weight", "uint32", (16, 8)),
                 ("up_proj.scales", "uint8", (16, 2)), ("up_proj.bias", "bfloat16", (16,)),
                 ("down_proj.weight", "uint32", (64, 2)), ("down_proj.scales", "uint8", (64, 1)),
                 ("down_proj.bias", "bfloat16", (64,))], {p: q for p in ("gate_proj", "up_proj", "down_proj")})
    s = make_layer_slots(lf, 3)
    assert not is_native_layer(lf) and s.native is None
    assert list(s.arrays) == [t.name for t in lf.tensors]
    assert s.arrays["gate_proj.scales"].dtype == mx.uint8 and s.arrays["gate_proj.scales"].shape == (3, 16, 2)
    assert s.arrays["down_proj.bias"].dtype == mx.bfloat16 and s.arrays["down_proj.bias"].shape == (3, 64)
    s.dest(1)["gate_proj.scales"][:] = np.arange(32, dtype=np.uint8)  # a read lands in the array itself
    assert np.array_equal(np.array(s.arrays["gate_proj.scales"][1]).ravel(), np.arange(32))
    with pytest.raises(TypeError, match="not a native Qwen3-Next layer"):
        _ = s.experts


def test_a_native_layer_keeps_its_layer_experts_over_the_same_arrays() -> None:
    q = Quant(bits=4, group_size=32)
    tensors = []
    for p, (o, i) in {"gate_proj": (16, 64), "up_proj": (16, 64), "down_proj": (64, 16 * 2)}.items():
        wq, sq = q.shapes((o, i))
        tensors += [(f"{p}.weight", "uint32", wq), (f"{p}.scales", "float16", sq), (f"{p}.biases", "float16", sq)]
    lf = _layer(tensors, {p: q for p in ("gate_proj", "up_proj", "down_proj")})
    s = make_layer_slots(lf, 2)
    assert is_native_layer(lf) and s.experts.gate_proj.weight is s.arrays["gate_proj.weight"]
    assert make_layer_slots(lf, 2, native=False).native is None
