"""The pool's slot arrays: per MoE layer, one stacked MLX array per expert tensor.

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

_MX_DTYPES = {"uint32": mx.uint32, "bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


@attrs.define
class LayerSlots:
    """One layer's stacked slot arrays and their host views."""

    layer: int
    capacity: int
    experts: LayerExperts
    host: dict[str, np.ndarray]  # tensor name -> uint8 [capacity, tensor nbytes], same memory as the arrays
    keep: list[mx.array]  # the raw buffers: referenced so MLX never donates or frees them

    def dest(self, slot: int) -> dict[str, WritableBuffer]:
        """Per-tensor destinations of `slot`, for `scatter_buffers`."""
        return {name: h[slot] for name, h in self.host.items()}

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.host.values())


def make_layer_slots(lf: LayerFile, capacity: int) -> LayerSlots:
    """Zeroed slot arrays for `capacity` experts of the layer `lf` describes. MLX thread only."""
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
    projs = {}
    for proj in PROJS:
        q = (lf.quant or {}).get(proj)
        w = arrays[f"{proj}.weight"]
        if q is None:
            projs[proj] = ProjWeights(w)
        else:
            projs[proj] = ProjWeights(w, arrays[f"{proj}.scales"], arrays.get(f"{proj}.biases"),
                                      q.group_size, q.bits, q.mode)
    _check_shared(arrays, host)
    return LayerSlots(lf.layer, capacity, LayerExperts(**projs), host, keep)


def _check_shared(arrays: dict[str, mx.array], host: dict[str, np.ndarray]) -> None:
    """The typed arrays must alias the host views (a copy would make every read invisible)."""
    for name, arr in arrays.items():
        as_bytes = arr.view(mx.uint8)
        mx.eval(as_bytes)
        if np.asarray(as_bytes).ctypes.data != host[name].ctypes.data:
            raise RuntimeError(f"slot array {name} does not share memory with its host view on this MLX build")
