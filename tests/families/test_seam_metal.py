"""Metal only (skipped elsewhere): the kernels pick their path from the expert stack's leading
dimension, so the pool's capacity must not change which kernel runs (experts.expert_view).

Sweeps prefill lengths 1..256 at capacities {k, k+1, E/4, E/2, E}:
- the family seam (PooledSwitch through GreenletBackend) against mlx-lm's forward, every step that
  ran each layer in one part bit-identical (parts change the shapes by design: families.md §3h.3;
  their differences are printed, not asserted);
- the native path's switch_glu over slot arrays against mlx-lm's SwitchGLU on the same experts.
Run on a Mac: `python tools/check_metal_families.py`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from qnpipe.model.experts import LayerExperts, ProjWeights, switch_glu
from qnpipe.model.family import tiny
from qnpipe.model.family.backend import GreenletBackend
from qnpipe.model.family.switches import expert_params
from tests.families.seam_pool import FakePool, drive, pool_switches, reference

pytestmark = pytest.mark.skipif(not mx.metal.is_available(), reason="Metal kernels only: run on a Mac")

LENGTHS = range(1, 257)


def _capacities(k: int, E: int) -> list[int]:
    return sorted({k, k + 1, max(E // 4, k), max(E // 2, k), E})


@pytest.mark.parametrize(("family", "quant"), [("qwen3_moe", "affine4"), ("qwen3_moe", None), ("gpt_oss", "mxfp4")])
def test_pooled_prefill_sweep_matches_mlx_lm_on_metal(family: str, quant: str | None) -> None:
    cfg = tiny.tiny_config(family)
    k = tiny.top_k(cfg)
    model = tiny.build_random(cfg, quant)
    rng = np.random.default_rng(0)
    prompts = {n: [int(t) for t in rng.integers(1, tiny.V, n)] for n in LENGTHS}
    want = {n: reference(model, [p])[0] for n, p in prompts.items()}
    switches = pool_switches(model)
    E = next(iter(switches.values())).num_experts
    bad, split = [], []
    for cap in _capacities(k, E):
        for n, p in prompts.items():
            pool = FakePool(switches, cap, seed=n)
            got = drive(GreenletBackend(model), pool, p, make_prompt_cache(model))
            if np.array_equal(got, want[n]):
                continue
            (split if pool.parts else bad).append((cap, n, float(np.abs(got - want[n]).max())))
    if split:
        print(f"{family} {quant}: {len(split)} split (parts) steps differ, e.g. {split[:5]}")
    assert not bad, f"one-part steps differ from mlx-lm (capacity, length, max diff): {bad[:10]}"


def test_native_switch_glu_sweep_matches_mlx_lm_on_metal() -> None:
    cfg = tiny.tiny_config("qwen3_moe")
    k, E = tiny.top_k(cfg), cfg["num_experts"]
    model = tiny.build_random(cfg, "affine4")
    sw = next(s for s in pool_switches(model).values()).template
    params = {n: np.array(a) for n, a in expert_params(sw).items()}
    rng = np.random.default_rng(1)
    bad = []
    for cap in _capacities(k, E):
        # The experts the router may pick: `cap` of them, in slots of expert order (the native path
        # sorts rows by slot, so this keeps mlx-lm's row order).
        experts = np.sort(rng.permutation(E)[:cap])
        projs = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(sw, proj)
            arr = {p: mx.array(params[f"{proj}.{p}"][experts]) for p in ("weight", "scales", "biases")}
            projs[proj] = ProjWeights(arr["weight"], arr["scales"], arr["biases"], lin.group_size, lin.bits, lin.mode)
        slots = LayerExperts(**projs).seen_as(E)
        lut = np.zeros(E, dtype=np.uint32)
        lut[experts] = np.arange(cap)
        for n in LENGTHS:
            x = mx.random.normal((1, n, cfg["hidden_size"]))
            inds = np.stack([rng.permutation(experts)[:k] for _ in range(n)])[None].astype(np.uint32)
            want = np.array(sw(x, mx.array(inds)))
            got = np.array(switch_glu(slots, x, mx.array(lut[inds])))
            if not np.array_equal(got, want):
                bad.append((cap, n, float(np.abs(got - want).max())))
    assert not bad, f"native switch_glu differs from mlx-lm (capacity, length, max diff): {bad[:10]}"
