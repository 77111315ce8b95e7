"""Dtype names: safetensors' (``F32``, ``BF16``), MLX's and the expert index's (``float32``), numpy storage.

The one table of each; numpy has no bfloat16, so bfloat16 travels as its uint16 bit patterns.
"""

from __future__ import annotations

import numpy as np

# safetensors dtype -> numpy storage dtype.
ST_NUMPY: dict[str, str] = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2", "BF16": "<u2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
}
# Bytes per element of every safetensors dtype (fp8 has no numpy storage type, so is listed apart).
ST_DTYPE_BYTES: dict[str, int] = {**{k: np.dtype(v).itemsize for k, v in ST_NUMPY.items()}, "F8_E4M3": 1, "F8_E5M2": 1}
# MLX / expert-index dtype name <-> safetensors dtype.
ST_OF_NAME: dict[str, str] = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "int32": "I32",
}
NAME_OF_ST: dict[str, str] = {v: k for k, v in ST_OF_NAME.items()}
# MLX / expert-index dtype name -> numpy storage dtype.
NP_DTYPES: dict[str, str] = {name: ST_NUMPY[st] for name, st in ST_OF_NAME.items()}
