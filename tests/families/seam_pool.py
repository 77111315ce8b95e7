"""A stand-in for qnpipe's pool, to drive the family seam in tests (families-proof.py's Pool).

Per pooled switch it owns fixed slot arrays of `capacity` slots (attached once, written in place
as the real pool's reads do). Each grant fills every slot with garbage (NaN for floats, random bits
otherwise), writes the granted experts' records at random slots, and answers with `PartGrant`s:
several parts when the step's experts do not fit, early grants (some experts still "being read")
when asked to. A read of a slot that was not granted therefore shows in the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from qnpipe.model.family.backend import GreenletBackend
from qnpipe.model.family.pooled import PooledSwitch
from qnpipe.model.family.switches import expert_params, find_switches
from qnpipe.model.stepper import EARLY_PAIRS
from qnpipe.steps import Event, LayerRoute, PartDone, PartGrant, Queued, StepDone


def pool_switches(model: Any) -> dict[int, PooledSwitch]:
    """Replace every switch of `model` by a PooledSwitch (not attached yet): layer -> switch."""
    out = {}
    for site in find_switches(model):
        p = PooledSwitch(site.module, site.layer)
        site.replace(p)
        out[site.layer] = p
    return out


class FakePool:
    def __init__(self, switches: dict[int, PooledSwitch], capacity: int, seed: int, *,
                 early_every: int = 0, swap: bool = False, by_expert: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.capacity = capacity
        self.early_every = early_every  # every n-th one-part step below EARLY_PAIRS gets early grants
        self.swap = swap  # negative control: two experts' slots swapped in every grant
        self.by_expert = by_expert  # a step that does not fit runs in expert-major parts (forward.parts=experts)
        self.records: dict[int, dict[str, np.ndarray]] = {}
        self.host: dict[int, dict[str, np.ndarray]] = {}
        self.routes = self.parts = self.early = self.max_pairs = 0
        self.min_pairs = 1 << 30
        for layer, sw in switches.items():
            params = expert_params(sw.template)
            self.records[layer] = {n: np.array(a) for n, a in params.items()}
            arrays = {n: mx.zeros((capacity, *a.shape[1:]), dtype=a.dtype) for n, a in params.items()}
            mx.eval(arrays)
            self.host[layer] = {n: np.asarray(a) for n, a in arrays.items()}
            assert all(h.flags.writeable for h in self.host[layer].values())
            sw.attach(arrays)

    def _fill(self, layer: int, experts: list[int]) -> np.ndarray:
        """Garbage in every slot, then the experts' records at random slots; their lut (-1 elsewhere)."""
        rec, host = self.records[layer], self.host[layer]
        E = next(iter(rec.values())).shape[0]
        where = self.rng.permutation(self.capacity)[: len(experts)]
        for name, h in host.items():
            if np.issubdtype(h.dtype, np.floating):
                h.fill(np.nan)
            else:
                h[...] = self.rng.integers(0, 256, size=h.shape).astype(h.dtype)
            h[where] = rec[name][experts]
        lut = np.full(E, -1, dtype=np.int64)
        lut[experts] = where
        if self.swap and len(experts) >= 2:
            a, b = experts[0], experts[1]
            lut[a], lut[b] = lut[b], lut[a]
        return lut

    def grants(self, route: LayerRoute) -> Iterator[PartGrant]:
        """The grants of one layer-step, in order (the forward answers Queued/PartDone in between)."""
        self.routes += 1
        ids = route.ids
        n, k = ids.shape
        self.max_pairs = max(self.max_pairs, ids.size)
        self.min_pairs = min(self.min_pairs, ids.size)
        ranges, lo, cur = [], 0, set()
        for t in range(n):
            row = set(ids[t].tolist())
            if len(cur | row) > self.capacity:
                ranges.append((lo, t))
                lo, cur = t, set()
            cur |= row
        ranges.append((lo, n))
        if self.by_expert and len(ranges) > 1:
            yield from self._by_expert(route)
            return
        if len(ranges) > 1:
            self.parts += len(ranges)
        early = (len(ranges) == 1 and ids.size < EARLY_PAIRS and self.early_every > 0
                 and self.routes % self.early_every == 0)
        for i, (lo, hi) in enumerate(ranges):
            part = ids[lo:hi]
            experts = sorted(set(part.reshape(-1).tolist()))
            lut = self._fill(route.layer, experts)
            last = i == len(ranges) - 1
            if early:
                self.early += 1
                # Two early grants: first half the experts "in memory", then all but one.
                for keep in (experts[: len(experts) // 2], experts[:-1]):
                    partial = np.full_like(lut, -1)
                    partial[keep] = lut[keep]
                    yield PartGrant(lo, hi, partial[part], last, early=True)
            yield PartGrant(lo, hi, lut[part], last)


    def _by_expert(self, route: LayerRoute) -> Iterator[PartGrant]:
        """Expert-major parts: the union in groups of `capacity`, each granted to the pairs of its experts."""
        ids = route.ids
        union = sorted(set(ids.reshape(-1).tolist()))
        groups = [union[i:i + self.capacity] for i in range(0, len(union), self.capacity)]
        self.parts += len(groups)
        for i, group in enumerate(groups):
            lut = self._fill(route.layer, group)
            mine = np.isin(ids, group)
            yield PartGrant(0, ids.shape[0], np.where(mine, lut[ids], -1), i == len(groups) - 1, by_expert=True)


def drive(backend: GreenletBackend, pool: FakePool, tokens: list[int], cache: list[Any],
          on_event: Callable[[Event], None] | None = None) -> np.ndarray:
    """One step through `backend.begin`/`resume`, answered by `pool`; the logits float32."""
    ev = backend.begin(lambda: mx.array(tokens)[None], cache, _logits)
    grants: Iterator[PartGrant] | None = None
    while not isinstance(ev, StepDone):
        if on_event is not None:
            on_event(ev)
        if isinstance(ev, LayerRoute):
            grants = pool.grants(ev)
        else:
            assert isinstance(ev, Queued | PartDone) and grants is not None
        ev = backend.resume(next(grants))
    assert grants is None or next(grants, None) is None, "a grant was left unasked"
    return ev.value


def _logits(logits: mx.array) -> np.ndarray:
    return np.array(logits.astype(mx.float32))


def reference(model: Any, steps: list[list[int]]) -> list[np.ndarray]:
    """mlx-lm's own forward of `steps` (one list of tokens a step) with its own cache."""
    cache = make_prompt_cache(model)
    return [_logits(model(mx.array(t)[None], cache=cache)) for t in steps]


def pooled(model: Any, pool: FakePool, steps: list[list[int]]) -> list[np.ndarray]:
    backend = GreenletBackend(model)
    cache = make_prompt_cache(model)
    return [drive(backend, pool, t, cache) for t in steps]
