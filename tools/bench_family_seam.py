"""What the family seam's mechanism costs per MoE layer-step; prints one JSON line.

- `greenlet_us` / `generator_us`: one round trip of a greenlet switch (GreenletBackend: the pooled
  switch switches up with its LayerRoute, the driver switches back with the grant) against one of a
  generator (MlxBackend's `send`), the bare mechanism.
- `pooled_step_us` / `template_step_us`: one decode step of a tiny qwen3_moe through GreenletBackend
  with every expert in the slots (a pool that answers at once with a ready grant) against mlx-lm's
  own forward with its switches as they are, per MoE layer; `overhead_us` is their difference: the
  host sync, the switch, the lut and the graph of the remapped projections. `synced_step_us`:
  mlx-lm's switches with only the host sync added (what any streamed path, the native one too,
  pays: the ids must reach the host), so `overhead_us - sync_us` is what the seam adds beyond it.

Several rounds, interleaved; `per_layer_step` has each figure's best round (the least disturbed by
other processes on a shared machine), `median` the median round. Usage:
    PYTHONPATH=. python tools/bench_family_seam.py [--rounds 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Generator

import greenlet
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from qnpipe.model.family import tiny
from qnpipe.model.family.backend import GreenletBackend
from qnpipe.model.family.pooled import PooledSwitch
from qnpipe.model.family.switches import expert_params, find_switches
from qnpipe.steps import LayerRoute, PartGrant, StepDone


def greenlet_round_trip_us(n: int) -> float:
    def body() -> None:
        parent = greenlet.getcurrent().parent
        assert parent is not None
        for _ in range(n):
            parent.switch(1)

    g = greenlet.greenlet(body)
    t = time.perf_counter()
    g.switch()
    while not g.dead:
        g.switch(0)
    return (time.perf_counter() - t) / n * 1e6


def generator_round_trip_us(n: int) -> float:
    def body() -> Generator[int, int, None]:
        for _ in range(n):
            yield 1

    gen = body()
    t = time.perf_counter()
    next(gen)
    try:
        while True:
            gen.send(0)
    except StopIteration:
        pass
    return (time.perf_counter() - t) / n * 1e6


def decode_us(model: nn.Module, steps: int, backend: GreenletBackend | None) -> float:
    """Mean µs of one decode step (after a short prefill, not timed)."""
    cache = make_prompt_cache(model)
    tail = lambda y: mx.eval(y)  # noqa: E731

    def step(tok: int) -> None:
        if backend is None:
            mx.eval(model(mx.array([[tok]]), cache=cache))
            return
        ev = backend.begin(lambda: mx.array([[tok]]), cache, tail)
        while not isinstance(ev, StepDone):
            assert isinstance(ev, LayerRoute)
            ev = backend.resume(PartGrant(0, len(ev.ids), ev.ids.astype(np.int64), True))  # slot = expert id

    for t in range(8):
        step(t + 1)
    t0 = time.perf_counter()
    for t in range(steps):
        step(t % 200 + 1)
    return (time.perf_counter() - t0) / steps * 1e6


class _Synced(nn.Module):
    """mlx-lm's switch with the streamed path's host sync in front (the ids read back)."""

    def __init__(self, template: nn.Module) -> None:
        super().__init__()
        self._held = (template,)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        np.array(indices)
        return self._held[0](x, indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--switches", type=int, default=200_000)
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    cfg = tiny.tiny_config("qwen3_moe")
    direct = tiny.build_random(cfg, "affine4")
    model = tiny.build_random(cfg, "affine4")
    synced = tiny.build_random(cfg, "affine4")
    for s in find_switches(synced):
        s.replace(_Synced(s.module))
    sites = find_switches(model)
    for s in sites:
        p = PooledSwitch(s.module, s.layer)
        arrays = {n: mx.array(v) for n, v in expert_params(s.module).items()}  # all E experts in the slots
        p.attach(arrays)
        s.replace(p)
    backend = GreenletBackend(model)
    rows: dict[str, list[float]] = {k: [] for k in ("greenlet_us", "generator_us", "pooled_step_us", "template_step_us",
                                                     "synced_step_us")}
    for _ in range(a.rounds):
        rows["greenlet_us"].append(greenlet_round_trip_us(a.switches))
        rows["generator_us"].append(generator_round_trip_us(a.switches))
        rows["template_step_us"].append(decode_us(direct, a.steps, None) / len(sites))
        rows["synced_step_us"].append(decode_us(synced, a.steps, None) / len(sites))
        rows["pooled_step_us"].append(decode_us(model, a.steps, backend) / len(sites))
    best, med = ({k: round(f(v), 3) for k, v in rows.items()} for f in (min, statistics.median))
    for d in (best, med):
        d["overhead_us"] = round(d["pooled_step_us"] - d["template_step_us"], 3)
        d["sync_us"] = round(d["synced_step_us"] - d["template_step_us"], 3)
    print(json.dumps({"bench": "family_seam", "family": "qwen3_moe", "quant": "affine4", "moe_layers": len(sites),
                      "rounds": a.rounds, "decode_steps": a.steps, "per_layer_step": best, "median": med,
                      "per_round": {k: [round(x, 3) for x in v] for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
