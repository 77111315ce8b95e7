"""The shared expert starts before the pool's reads on the generic tier and the block takes that very result:
logits stay mlx-lm's bit for bit, and the hand-over happens at every MoE layer-step of the families with one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.model.family import tiny
from qnpipe.model.family.shared_ahead import handed, shared_of, start
from qnpipe.model.family.switches import find_switches
from tests.families.seam_pool import FakePool, pooled, reference

STEPS = [[5, 9, 3, 7, 1, 2, 8], [4], [6]]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "qwen2_moe"])
def test_the_block_takes_the_early_shared_expert_and_the_bits_stay(family: str) -> None:
    model = tiny.build_random(tiny.tiny_config(family), "affine4")
    want = reference(model, STEPS)
    sites = find_switches(model)
    from qnpipe.model.family.pooled import PooledSwitch

    switches, shared = {}, []
    for s in sites:
        p = PooledSwitch(s.module, s.layer)
        s.replace(p)
        assert p.share_ahead(s.parent), family
        switches[s.layer] = p
        shared.append(s.parent.get(next(n for n in ("shared_expert", "shared_experts") if n in s.parent)))
    pool = FakePool(switches, tiny.top_k(tiny.tiny_config(family)) + 1, seed=3)
    got = pooled(model, pool, STEPS)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert [handed(m) for m in shared] == [len(STEPS)] * len(sites)


def test_another_input_is_computed_as_before() -> None:
    model = tiny.build_random(tiny.tiny_config("qwen2_moe"))
    block = find_switches(model)[0].parent
    m = shared_of(block)
    assert m is not None and shared_of(block) is m  # made once
    x, other = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    want = type(m).__mro__[1].__call__(m, other)
    start(m, x)
    assert mx.array_equal(m(other), want).item() and handed(m) == 0
    start(m, x)
    y = m(x)
    assert handed(m) == 1 and mx.array_equal(y, type(m).__mro__[1].__call__(m, x)).item()


def test_a_block_without_a_shared_expert_has_none() -> None:
    model = tiny.build_random(tiny.tiny_config("qwen3_moe"))
    assert shared_of(find_switches(model)[0].parent) is None
