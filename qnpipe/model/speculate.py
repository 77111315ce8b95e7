"""Hits queued before the pool answers: a layer's experts started from the slots they had last time.

`forward_steps` syncs on each MoE router (`mx.eval(inds)`) and then waits for the pool's grant; the
device has nothing to do from the sync until the experts are queued. With a `Speculation` the
forward queues the layer's experts *before* that sync, from a per-layer expert -> slot map kept as
a device array (`LayerMap`, int32, -1 absent), and uses that output when the grant confirms it:
one full part whose slots equal the map's, with no slot written meanwhile. Otherwise it discards
the output and computes from the grant as without speculation (misses, parts, early grants).

Bit for bit: a confirmed output is the same kernel (`switch_glu`) on the same inputs as the
grant's path (the same slot ids, as uint32, in the same shape, over the same slot bytes).

Why the speculative graph never reads a slot while it is being rewritten, when it is used:
every write into slot memory is a read of the live device (qnpipe.io.device.StoreDevice), which
brackets each batch with `SlotWrites.begin` / `end`. The forward queues only when no write is in
flight (`quiet`, checked before the graph is queued) and uses the output only when no write began
since (`SlotWrites.epoch` unchanged when the grant arrives). So slot memory did not change from
before the graph was queued until the grant; from the grant on, the granted slots are held, and
the forward releases them only after an `mx.eval` that depends on the layer's output. The grant
names what each slot holds at that moment, so the slots the graph read held those experts' bytes.
A discarded graph may read a slot during a write: its output is never used, and slot memory is
never freed while a graph references it (MLX keeps the arrays alive).

The map is learned from the grants (one full part each; the pool's decisions stay its own): a
stale entry makes a mismatch, never a wrong result. Native path only (`native_run` over
`LayerExperts`); the family seam (qnpipe.model.family.pooled) maps ids to slots its own way and
does not speculate. The MTP head's layer does not either (its reads go to another device).
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from qnpipe.io.slot_writes import SlotWrites


@attrs.define(eq=False)
class LayerMap:
    """One layer's expert -> slot map, on the host and as a device array (rebuilt only when it changes)."""

    host: np.ndarray  # int32 [experts], -1 absent
    dev: mx.array


@attrs.frozen
class Speculated:
    """A layer's experts queued from the map: the layer's output if the grant confirms it."""

    h: mx.array
    host: np.ndarray  # the map it used (never mutated: a change makes a new array)
    epoch: int


@attrs.define(eq=False)
class Speculation:
    """The forward's speculation state over all its layers. MLX thread only (but `writes`)."""

    writes: SlotWrites
    num_experts: int
    maps: dict[int, LayerMap] = attrs.field(factory=dict)
    # Layers whose last speculation was discarded and no full grant has taught the map since: a miss
    # makes early grants, which teach nothing, and each discarded guess costs the device the work.
    doubtful: set[int] = attrs.field(factory=set)
    confirmed: int = 0  # layer-steps that used the speculated output (tests, benchmarks)
    discarded: int = 0

    def slots(self, layer: int, inds: mx.array) -> tuple[mx.array, np.ndarray, int] | None:
        """The slots `[..., k]` (uint32, device) the map gives the router's `inds`, the map, the write
        epoch; None when there is no map yet or a write is in flight."""
        m = self.maps.get(layer)
        if m is None or layer in self.doubtful:
            return None
        epoch = self.writes.quiet()
        if epoch is None:
            return None
        # An absent expert (-1) reads slot 0: the output is discarded (`confirm` sees the -1).
        return mx.maximum(m.dev[inds], 0).astype(mx.uint32), m.host, epoch

    def confirm(self, layer: int, spec: Speculated, ids: np.ndarray, slots: np.ndarray | None) -> bool:
        """Whether the grant's `slots` (one full part, shaped like `ids`; None for any other grant) are
        those `spec` ran on, with no slot written since it was queued."""
        ok = (slots is not None and self.writes.epoch == spec.epoch
              and np.array_equal(spec.host[ids], slots.reshape(ids.shape)))
        if ok:
            self.confirmed += 1
        else:
            self.discarded += 1
            self.doubtful.add(layer)
        return ok

    def learn(self, layer: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """Take a full grant's (expert, slot) pairs into the map."""
        self.doubtful.discard(layer)
        m = self.maps.get(layer)
        flat_ids, flat_slots = ids.reshape(-1), slots.reshape(-1).astype(np.int32)
        if m is not None and np.array_equal(m.host[flat_ids], flat_slots):
            return
        host = np.full(self.num_experts, -1, dtype=np.int32) if m is None else m.host.copy()
        # A slot now given to another expert is no longer the old one's.
        host[np.isin(host, flat_slots)] = -1
        host[flat_ids] = flat_slots
        self.maps[layer] = LayerMap(host, mx.array(host))
