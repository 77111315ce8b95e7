"""The family seam on every switch family: mlx-lm's own forward with its switches pooled gives
logits bit-identical to mlx-lm's forward of the same weights (families.md §4, the issue's "Must show").

Each family of qnpipe.model.family.tiny, float32 and affine 4-bit (gpt-oss also mxfp4), at
capacities top-k+1, half and all: a prefill of >= 64 (token, expert) pairs (the switch sorts its
rows), the same prompt in chunks of < 64 pairs (no sort; some layer-steps on early grants), then
decode steps. Driven through GreenletBackend's begin/resume by a fake pool whose unused slots hold
NaN or random bits. A pool that swaps two experts' slots must change the logits.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from qnpipe.model.family import tiny
from qnpipe.model.family.registry import FIRST
from qnpipe.model.family.switches import expert_params, find_switches
from tests.families.seam_pool import FakePool, pool_switches, pooled, reference

# The first eight families and the native one stay in the fast loop (`-m "not slow"`); CI runs every family.
CASES = [pytest.param(f, q, id=f"{f}-{q or 'float32'}",
                      marks=() if f in (*FIRST, "qwen3_next") else pytest.mark.slow)
         for f in tiny.CONFIGS for q in (None, "affine4", *(("mxfp4",) if f == "gpt_oss" else ()))]


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(("family", "quant"), CASES)
def test_pooled_logits_are_mlx_lm_s_bit_for_bit(family: str, quant: str | None) -> None:
    cfg = tiny.tiny_config(family)
    k = tiny.top_k(cfg)
    model = tiny.build_random(cfg, quant)
    rng = np.random.default_rng(7)
    # >= 64 pairs in every MoE layer (hunyuan's smallest top-k is 2, llama4's is 1).
    prompt = [int(t) for t in rng.integers(1, tiny.V, max(40, 64 // k + 8))]
    decode = [[int(t)] for t in rng.integers(1, tiny.V, 3)]
    chunk = max(1, 63 // (2 * k))  # < 64 pairs a layer-step
    chunks = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)]
    full_steps, chunk_steps = [prompt, *decode], [*chunks, *decode]
    want_full, want_chunks = reference(model, full_steps), reference(model, chunk_steps)

    switches = pool_switches(model)
    E = next(iter(switches.values())).num_experts
    for cap in sorted({min(E, k + 1), max(E // 2, k + 1), E}):
        pool = FakePool(switches, cap, seed=cap * 31, early_every=2)
        assert _same(pooled(model, pool, full_steps), want_full), f"prefill, capacity {cap}/{E}"
        assert pool.max_pairs >= 64, "the prefill must take the switch's sorted path"
        if cap < E:  # expert-major parts (forward.parts=experts): each pair's row as in one pass
            pool = FakePool(switches, cap, seed=cap * 31 + 2, by_expert=True)
            assert _same(pooled(model, pool, full_steps), want_full), f"expert-major parts, capacity {cap}/{E}"
            assert cap > k + 1 or pool.parts > 0, "top-k+1 slots must split some layer-step into expert parts"
        pool = FakePool(switches, cap, seed=cap * 31 + 1, early_every=2)
        got = pooled(model, pool, chunk_steps)
        assert _same(got, want_chunks), f"chunked prefill and decode, capacity {cap}/{E}"
        assert pool.max_pairs < 64
        assert all(np.isfinite(a).all() for a in got)
        if cap == min(E, k + 1) and cap < E:
            assert pool.parts > 0, "top-k+1 slots must split some layer-step into parts"
        if cap == E:
            assert pool.early > 0, "some layer-steps must run on early grants"
    # The check can fail: a pool that puts two experts' records in each other's slot must differ.
    swapped = FakePool(switches, E, seed=5, swap=True)
    assert not _same(pooled(model, swapped, full_steps), want_full), "negative control passed"


def test_the_template_is_outside_mlx_s_module_tree() -> None:
    model = tiny.build_random(tiny.tiny_config("qwen3_moe"))
    paths = [s.path for s in find_switches(model)]
    switches = pool_switches(model)
    names = [n for n, _ in tree_flatten(model.parameters())]
    assert not [n for n in names if any(n.startswith(p + ".") for p in paths)], "expert tensors stayed parameters"
    leaves = [n for n, _ in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))]
    assert not [n for n in leaves if any(n.startswith(p + ".") for p in paths)]
    # update_modules and nn.quantize walk the tree: the template and its float weights stay as they were.
    sw = next(iter(switches.values()))
    before = np.array(expert_params(sw.template)["gate_proj.weight"])
    model.update_modules(model.children())
    tiny.quantize(model, "affine4")
    assert type(sw.template["gate_proj"]).__name__ == "SwitchLinear"
    assert np.array_equal(np.array(expert_params(sw.template)["gate_proj.weight"]), before)
    pool = FakePool(switches, 6, seed=1)
    slots = sw._held.slots
    assert slots is not None
    assert type(slots.module["gate_proj"]._run.template).__name__ == "SwitchLinear"
    assert pool.routes == 0


def test_attach_refuses_arrays_that_are_not_the_switch_s() -> None:
    model = tiny.build_random(tiny.tiny_config("mixtral"))
    sw = next(iter(pool_switches(model).values()))
    good = {n: mx.zeros((3, *a.shape[1:]), dtype=a.dtype) for n, a in expert_params(sw.template).items()}
    with pytest.raises(ValueError, match="expert tensors"):
        sw.attach({k: v for k, v in good.items() if not k.startswith("down_proj")})
    with pytest.raises(ValueError, match="float16"):
        sw.attach({**good, "up_proj.weight": good["up_proj.weight"].astype(mx.float16)})
    with pytest.raises(ValueError, match="capacities"):
        sw.attach({**good, "up_proj.weight": mx.zeros((4, *good["up_proj.weight"].shape[1:]))})
    sw.attach(good)
    assert sw.slot_arrays is not None
    sw.detach()
    assert sw.slot_arrays is None


def test_kernels_see_the_model_s_expert_count_on_both_paths() -> None:
    """Metal fix (experts.expert_view): an E-shaped view of the slot arrays, sharing their memory,
    changes no bit on the CPU; the native path's MlxBackend hands it to its kernels too."""
    from qnpipe.model.experts import LayerExperts, ProjWeights, expert_view, switch_glu

    slots = mx.random.normal((3, 8, 32))
    mx.eval(slots)
    assert expert_view(slots, 3) is slots and expert_view(slots, 2) is slots
    view = expert_view(slots, 16)
    assert view.shape == (16, 8, 32)
    np.asarray(slots)[2] = 7.0  # a read into the slots shows through the view
    assert np.array_equal(np.array(view[2]), np.full((8, 32), 7.0, dtype=np.float32))
    w = ProjWeights(*mx.quantize(mx.random.normal((3, 32, 32)), 32, 4), group_size=32, bits=4)
    le = LayerExperts(w, w, w)
    seen = le.seen_as(16)
    assert seen.num_slots == 3 and seen.gate_proj._kernel[0].shape[0] == 16
    x = mx.random.normal((1, 40, 32))
    ids = mx.array(np.random.default_rng(0).integers(0, 3, (1, 40, 2)).astype(np.uint32))  # 80 pairs: sorted
    assert np.array_equal(np.array(switch_glu(le, x, ids)), np.array(switch_glu(seen, x, ids)))
    from types import SimpleNamespace

    from qnpipe.model.stepper import MlxBackend

    be = MlxBackend(SimpleNamespace(args=SimpleNamespace(num_experts=16)), {5: le})  # type: ignore[arg-type]
    assert be.slots is not None and be.slots[5].down_proj._kernel[0].shape[0] == 16
