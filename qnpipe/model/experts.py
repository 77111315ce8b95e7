"""Routed-expert weights by slot index, and the SwiGLU gather kernels that run them.

A layer's experts live in stacked arrays `[slots, out, in(/packed)]`. The MoE block hands
an `ExpertSource` the expert ids its router picked; the source maps them to slots and runs
`gather_qmm` / `gather_mm` on the stacked arrays, in mlx-lm's SwitchGLU order (up, gate,
down; rows sorted by slot when there are >= 64 of them) so results match mlx-lm exactly.

The kernels see a stack of the model's expert count, not of the pool's capacity (`expert_view`):
on Metal `gather_qmm`/`gather_mm` pick their kernel and tiles from the stack's leading dimension
(docs/architecture.md, the family seam).
"""

from __future__ import annotations

from typing import Protocol

import attrs
import mlx.core as mx
from mlx_lm.models.activations import swiglu

PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_view(a: mx.array, experts: int) -> mx.array:
    """`a [S, ...]` seen as `[experts, ...]` (same memory, row-contiguous strides) when `experts > S`.

    Metal's `GatherQMM`/`GatherMM` choose the rhs kernel (`B / E >= 4`) and the NAX tiles (`M / E`)
    from E, the stack's leading dimension. mlx-lm runs with E = the model's expert count; a pool of
    `S` slots would run another kernel for some prefill lengths and differ in the last bits. The
    view gives the kernel mlx-lm's E; slot ids stay below S, so no row past the buffer is read.
    CPU kernels never read E: there it changes nothing (tests hold it bit for bit).
    `a` must be row-contiguous (slot arrays are): the view then shares its memory, so reads into
    the slots later show through it.
    """
    if experts <= a.shape[0]:
        return a
    shape = (experts, *a.shape[1:])
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    view = mx.as_strided(a, shape, strides)
    mx.eval(view)
    return view


@attrs.frozen
class ProjWeights:
    """One stacked projection: float `weight [S, out, in]`, or affine-quantized weight/scales/biases."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 64
    bits: int = 0  # 0 = not quantized
    mode: str = "affine"
    experts: int = 0  # the kernels see the stack as [experts, ...] when larger than it (expert_view)
    _kernel: tuple[mx.array, mx.array | None, mx.array | None] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # Built once: the hot path only reads them.
        views = tuple(None if a is None else expert_view(a, self.experts)
                      for a in (self.weight, self.scales, self.biases))
        object.__setattr__(self, "_kernel", views)

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def apply(self, x: mx.array, slots: mx.array, sorted_indices: bool) -> mx.array:
        weight, scales, biases = self._kernel
        assert weight is not None
        if scales is not None:
            return mx.gather_qmm(
                x, weight, scales, biases,
                rhs_indices=slots, transpose=True,
                group_size=self.group_size, bits=self.bits, mode=self.mode,
                sorted_indices=sorted_indices,
            )
        return mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=slots, sorted_indices=sorted_indices)

    @property
    def nbytes_per_slot(self) -> int:
        n = self.weight.nbytes
        if self.scales is not None:
            n += self.scales.nbytes + (self.biases.nbytes if self.biases is not None else 0)
        return n // self.weight.shape[0]


@attrs.frozen
class LayerExperts:
    """The three stacked projections of one MoE layer."""

    gate_proj: ProjWeights
    up_proj: ProjWeights
    down_proj: ProjWeights

    @property
    def num_slots(self) -> int:
        return self.gate_proj.weight.shape[0]

    def seen_as(self, experts: int) -> LayerExperts:
        """The same slots, run by kernels that see a stack of `experts` (the model's count)."""
        return LayerExperts(*(attrs.evolve(getattr(self, p), experts=experts) for p in PROJS))

    @property
    def nbytes_per_expert(self) -> int:
        return sum(getattr(self, p).nbytes_per_slot for p in PROJS)


def switch_glu(w: LayerExperts, x: mx.array, slots: mx.array) -> mx.array:
    """Run the experts at `slots [..., k]` on `x [..., H]`; returns `[..., k, H]`."""
    x = mx.expand_dims(x, (-2, -3))
    do_sort = slots.size >= 64
    idx = slots
    inv_order = None
    if do_sort:
        # Sorting rows by slot makes each expert's rows contiguous for gather_*mm.
        m = slots.shape[-1]
        flat = slots.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        x = x.flatten(0, -3)[order // m]
        idx = flat[order]
    up = w.up_proj.apply(x, idx, do_sort)
    gate = w.gate_proj.apply(x, idx, do_sort)
    y = w.down_proj.apply(swiglu(gate, up), idx, do_sort)
    if do_sort:
        y = mx.unflatten(y[inv_order], 0, slots.shape)
    return y.squeeze(-2)


class ExpertSource(Protocol):
    """What a MoE block calls to run its routed experts."""

    def __call__(self, layer: int, x: mx.array, experts: mx.array) -> mx.array:
        """Run `experts [..., k]` (router's ids) of `layer` on `x [..., H]`; returns `[..., k, H]`."""
        ...


@attrs.define
class ResidentExperts:
    """Every expert of every layer in memory; slot index == expert id (the all-resident reference)."""

    layers: dict[int, LayerExperts]

    def __call__(self, layer: int, x: mx.array, experts: mx.array) -> mx.array:
        return switch_glu(self.layers[layer], x, experts)

    @property
    def nbytes(self) -> int:
        return sum(le.nbytes_per_expert * le.num_slots for le in self.layers.values())
