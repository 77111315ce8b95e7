"""The pool's slot arrays: per MoE layer, one stacked MLX array per expert tensor.

`LayerSlots.arrays` holds them by record tensor name (`gate_proj.weight`, `fc1.scales`, ...),
each `[capacity, ...]`: what a family's pooled switch runs mlx-lm's switch code on. A native
Qwen3-Next layer (gate/up/down weight, scales, biases) also gets them as qnpipe's own
`LayerExperts` (`LayerSlots.experts`, for `experts.switch_glu`).

Slot `s` of a layer holds one expert's record, tensor by tensor (`gate_proj.weight[s]`,
`gate_proj.scales[s]`, ...). The arrays live in MLX-owned memory with writable host
views, so a read scatters a record straight into its slot (io.reader.scatter_buffers)
and the gather kernels read it with no copy. The pool's table decides what goes where;
this module only holds the memory.

The one rule for writing a slot: never while an MLX computation queued before the write
may still read it. The pool only rewrites a slot that no step holds, and the forward
releases a layer's grant only after an `mx.eval` whose result depends on that layer's
expert outputs (qnpipe.actors.forward), so every reader of the old bytes has finished.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from qnpipe.io.reader import WritableBuffer, mlx_aligned_buffer
from qnpipe.io.store_format import LayerFile
from qnpipe.model.experts import PROJS, LayerExperts, ProjWeights

_MX_DTYPES = {"uint32": mx.uint32, "uint8": mx.uint8, "bfloat16": mx.bfloat16, "float16": mx.float16,
              "float32": mx.float32}
_NATIVE_PARTS = ("weight", "scales", "biases")


@attrs.define
class LayerSlots:
    """One layer's stacked slot arrays and their host views."""

    layer: int
    capacity: int
    native: LayerExperts | None  # the arrays as qnpipe's Qwen3-Next LayerExperts; None on other layers
    host: dict[str, np.ndarray]  # tensor name -> uint8 [capacity, tensor nbytes], same memory as the arrays
    keep: list[mx.array]  # the raw buffers: referenced so MLX never donates or frees them
    arrays: dict[str, mx.array] = attrs.Factory(dict)  # record tensor name -> [capacity, ...] slot array

    @property
    def experts(self) -> LayerExperts:
        """The slots as a native Qwen3-Next layer's LayerExperts (`experts.switch_glu`)."""
        if self.native is None:
            raise TypeError(f"layer {self.layer}'s slots hold {list(self.arrays)}: not a native Qwen3-Next "
                            f"layer (use LayerSlots.arrays)")
        return self.native

    def dest(self, slot: int) -> dict[str, WritableBuffer]:
        """Per-tensor destinations of `slot`, for `scatter_buffers`."""
        return {name: h[slot] for name, h in self.host.items()}

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.host.values())


def is_native_layer(lf: LayerFile) -> bool:
    """True when `lf`'s records are a native Qwen3-Next layer's: gate/up/down `weight`, and `scales`
    and `biases` of affine quantization, nothing else."""
    names = [t.name for t in lf.tensors]
    if any(f"{p}.weight" not in names for p in PROJS):
        return False
    if any(q.mode != "affine" or q.global_scale for q in (lf.quant or {}).values()):
        return False
    return all(n in {f"{p}.{part}" for p in PROJS for part in _NATIVE_PARTS} for n in names)


def make_layer_slots(lf: LayerFile, capacity: int, *, native: bool | None = None) -> LayerSlots:
    """Zeroed slot arrays for `capacity` experts of the layer `lf` describes. MLX thread only.

    `native` (default: `is_native_layer(lf)`) also builds the native LayerExperts view."""
    arrays: dict[str, mx.array] = {}
    host: dict[str, np.ndarray] = {}
    keep: list[mx.array] = []
    for t in lf.tensors:
        raw, h = mlx_aligned_buffer(capacity * t.nbytes)
        typed = raw[: capacity * t.nbytes].view(_MX_DTYPES[t.dtype]).reshape(capacity, *t.shape)
        mx.eval(typed)
        arrays[t.name] = typed
        host[t.name] = h[: capacity * t.nbytes].reshape(capacity, t.nbytes)
        keep += [raw, typed]
    _check_shared(arrays, host)
    if not (is_native_layer(lf) if native is None else native):
        return LayerSlots(lf.layer, capacity, None, host, keep, arrays)
    projs = {}
    for proj in PROJS:
        q = (lf.quant or {}).get(proj)
        w = arrays[f"{proj}.weight"]
        if q is None:
            projs[proj] = ProjWeights(w)
        else:
            projs[proj] = ProjWeights(w, arrays[f"{proj}.scales"], arrays.get(f"{proj}.biases"),
                                      q.group_size, q.bits, q.mode)
    return LayerSlots(lf.layer, capacity, LayerExperts(**projs), host, keep, arrays)


def _check_shared(arrays: dict[str, mx.array], host: dict[str, np.ndarray]) -> None:
    """The typed arrays must alias the host views (a copy would make every read invisible)."""
    for name, arr in arrays.items():
        as_bytes = arr.view(mx.uint8)
        mx.eval(as_bytes)
        if np.asarray(as_bytes).ctypes.data != host[name].ctypes.data:
            raise RuntimeError(f"slot array {name} does not share memory with its host view on this MLX build")
