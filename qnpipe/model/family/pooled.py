"""`PooledSwitch`: one `SwitchGLU`/`SwitchMLP` of an mlx-lm model, its experts run from the pool's slots.

It stands where the switch was (`SwitchSite.replace`), so mlx-lm's own forward calls it with the
router's `(x, indices)`. It reads the ids back (the layer's one host sync), switches up to the
driver greenlet (qnpipe.model.family.backend) with a `LayerRoute`, and gets `PartGrant`s back; the
experts then run through mlx-lm's own `SwitchGLU`/`SwitchMLP`/`QuantizedSwitchLinear` code over
copies of the switch's expert linears whose arrays are the pool's `[capacity, ...]` slot arrays.
Activation, per-expert biases, quantization mode, op order and sort rule are mlx-lm's own.

Mode "proj" (the only one): mlx-lm's code sorts the rows by expert id, its own row order, and each
projection maps the ids to slots on the device through a lut. Mapping before the sort ("slot") would
sort by slot instead: equal on the CPU, but on Metal another row order can mean another kernel. The
mapped slot ids are grouped but not ascending, which Metal's rhs kernel allows: it only looks for
changes of index inside a tile (families.md §3a).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import greenlet
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from qnpipe.model.experts import expert_view
from qnpipe.model.family.backend import Step, Stopped
from qnpipe.model.family.shared_ahead import shared_of, start
from qnpipe.model.family.switches import expert_linears, expert_params
from qnpipe.model.stepper import run_parts
from qnpipe.steps import LayerRoute, PartDone, Queued


class _Remap(nn.Module):
    """An expert linear called with expert ids that runs on their slots: `lut[ids]` on the device.
    The lut is the switch's current one (`_Slots.lut`), set before each run."""

    def __init__(self, inner: nn.Module, slots: _Slots) -> None:
        super().__init__()
        self._run = _Held(inner, slots)  # a plain object: an attribute, no child (see _Held)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        run = self._run
        slots = run.slots
        assert slots is not None
        # mlx-lm hands every projection of a run the same ids: map them once.
        if slots.mapped is None or slots.mapped[0] is not indices:
            slots.mapped = (indices, slots.lut[indices])
        return run.template(x, slots.mapped[1], sorted_indices=sorted_indices)


@attrs.define(eq=False)
class _Slots:
    """The attached slot arrays and the template's copy that runs on them, built once per attach."""

    arrays: dict[str, mx.array]
    capacity: int
    module: Any = None  # the template's copy whose expert linears are `_Remap`s over the slot arrays
    lut: Any = None  # mx.array [E] uint32: expert id -> slot, of the run being built
    mapped: tuple[mx.array, mx.array] | None = None  # (ids, lut[ids]) of the run being built


def _clone(m: nn.Module) -> nn.Module:
    """A shallow copy made without `__init__` (which would draw random weights); `object.__new__`
    is refused for `nn.Module`, a dict."""
    c = type(m).__new__(type(m))
    nn.Module.__init__(c)
    c.__dict__.update(m.__dict__)
    dict.update(c, m.items())
    return c


@attrs.define(eq=False)
class _Held:
    """What a PooledSwitch keeps out of MLX's module tree: a plain object, not a dict, list or
    array, so `Module.__setattr__` stores it as an attribute that `parameters()`, `leaf_modules()`,
    `update_modules()` and `nn.quantize` never walk into (families.md §0 trap 4(c))."""

    template: nn.Module
    slots: _Slots | None = None
    shared: nn.Module | None = None  # the block's shared expert, started before the pool's reads (shared_ahead)


class PooledSwitch(nn.Module):
    """Replaces the switch `template` of decoder layer `layer` (a model of `num_experts` experts).

    Without slot arrays attached (every expert resident) it calls the template itself. With them
    (`attach`), each call goes through the pool: it must then run inside a greenlet whose parent
    drives the step (GreenletBackend).
    """

    def __init__(self, template: nn.Module, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts = int(next(iter(expert_params(template).values())).shape[0])
        self._held = _Held(template)
        # (layer, x) -> [(target layer, ids, scores)], lazy (qnpipe.model.family.routers.FamilyPredictor).
        self.predictor: Callable[[int, mx.array], list[tuple[int, mx.array, mx.array]]] | None = None

    @property
    def template(self) -> nn.Module:
        return self._held.template

    @property
    def slot_arrays(self) -> dict[str, mx.array] | None:
        return None if self._held.slots is None else self._held.slots.arrays

    def attach(self, arrays: dict[str, mx.array]) -> None:
        """Run the experts from `arrays` (record tensor name -> `[capacity, ...]`, the pool's slots of
        this layer) from now on. The copies that run on them are built here, once, not per call."""
        want = expert_params(self.template)
        if set(arrays) != set(want):
            raise ValueError(f"layer {self.layer}: slot arrays {sorted(arrays)} are not the switch's "
                             f"expert tensors {sorted(want)}")
        capacity = {int(a.shape[0]) for a in arrays.values()}
        if len(capacity) != 1:
            raise ValueError(f"layer {self.layer}: slot arrays of different capacities {sorted(capacity)}")
        for name, a in arrays.items():
            w = want[name]
            if a.shape[1:] != w.shape[1:] or a.dtype != w.dtype:
                raise ValueError(f"layer {self.layer}: slot array {name} is {a.dtype}{list(a.shape)}, the "
                                 f"switch's is {w.dtype}{list(w.shape)} (capacity first)")
        slots = _Slots(dict(arrays), capacity.pop())
        module = _clone(self.template)
        for lname, lin in expert_linears(self.template).items():
            copy = _clone(lin)
            for p, a in lin.items():
                if isinstance(a, mx.array):
                    # The kernels see the model's expert count, not the capacity (experts.expert_view).
                    copy[p] = expert_view(arrays[f"{lname}.{p}"], self.num_experts)
            module[lname] = _Remap(copy, slots)
        slots.module = module
        self._held.slots = slots

    def share_ahead(self, block: Any) -> bool:
        """Start the shared expert of `block` (the MoE block holding this switch) before each wait for
        the pool, as the native path does (qnpipe.model.family.shared_ahead). False: it has none."""
        self._held.shared = shared_of(block)
        return self._held.shared is not None

    def detach(self) -> None:
        """Back to the template (every expert resident)."""
        self._held.slots = None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        slots = self._held.slots
        if slots is None:
            return self.template(x, indices)
        preds = self.predictor(self.layer, x) if self.predictor is not None else []
        synced = (indices, *[a for _, i, p in preds for a in (i, p)])
        step = greenlet.getcurrent()
        mine = step if isinstance(step, Step) else None  # the step's greenlet carries the forward's hits, first_sync
        if mine is not None and mine.held is not None:
            # The previous switch's hit takes its turn once this layer's router is queued too (as the native
            # path, qnpipe.model.stepper.forward_steps): taken before, it would hold the device back.
            mx.async_eval(*synced)
            mine.take_held()
        if preds:
            mx.eval(*synced)  # one host sync for all
        ids = np.array(indices)  # the one host sync of the layer: the router's ids
        parent = step.parent
        if parent is None:
            raise RuntimeError(f"layer {self.layer}: a pooled switch runs inside GreenletBackend's step")
        if mine is not None and (first_sync := mine.first_sync) is not None:
            mine.first_sync = None
            if not first_sync():
                raise Stopped
        if self._held.shared is not None:  # it computes while the pool answers and reads
            start(self._held.shared, x)
        predictions = tuple((t, np.array(i).reshape(-1, i.shape[-1]), np.array(p).reshape(-1, p.shape[-1]))
                            for t, i, p in preds)
        route = LayerRoute(self.layer, ids.reshape(-1, ids.shape[-1]), predictions)
        if mine is not None and mine.hits is not None and (hit := mine.hits.hit_slots(route)) is not None:
            # As the native path (qnpipe.model.stepper.forward_steps): the one-part grant's very call, queued;
            # the forward's turn for it comes later, while the device computes.
            y = self._runner(slots)(x, ids, hit.reshape(ids.shape))
            mx.async_eval(y)
            mine.held = (route, hit)  # its turn: at the next switch, or at the step's end (backend._run)
            return y
        grant = parent.switch(route)
        steps = run_parts(self._runner(slots), x, ids, grant)
        try:
            ev: PartDone | Queued = next(steps)
            while True:
                ev = steps.send(parent.switch(ev))
        except StopIteration as done:
            y: mx.array = done.value
        except BaseException:
            # Dropped mid-step (GreenletBackend.abort throws GreenletExit here): closing the parts
            # evaluates the work queued on early grants before the driver releases their slots.
            steps.close()
            raise
        # Start the experts while mlx-lm's code builds the rest of the layer up to the next router.
        mx.async_eval(y)
        return y

    def _runner(self, slots: _Slots) -> Callable[[mx.array, np.ndarray, np.ndarray], mx.array]:
        E = self.num_experts

        def run(x: mx.array, ids: np.ndarray, granted: np.ndarray) -> mx.array:
            # Every (token, expert) pair's slot -> a per-expert lut; pairs not granted yet (-1, early
            # grants) are not run, so their entries stay 0 and are never read.
            lut = np.zeros(E, dtype=np.uint32)
            ok = granted >= 0
            lut[ids[ok]] = granted[ok]
            # The graph built below holds this lut: swapping it for the next run cannot change it.
            slots.lut, slots.mapped = mx.array(lut), None
            return slots.module(x, mx.array(ids))

        return run

