"""A (token, expert) pair's expert output does not depend on the other pairs of its kernel call.

Expert-major parts (qnpipe.model.stepper._expert_parts, forward.parts=experts) run a layer's pairs
in several calls of other sizes and compositions than the one-pass call (sorted by the switch at
>= 64 pairs, unsorted below), then put them back in the router's order: the logits stay
bit-identical for any pool size only if every row is computed the same whoever shares its call.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.model.experts import LayerExperts, ProjWeights, switch_glu
from qnpipe.model.stepper import EARLY_PAIRS, native_run, run_parts
from qnpipe.steps import PartDone, PartGrant

E, H, INTER, K, N = 16, 64, 96, 4, 40


def _experts(bits: int, dtype: mx.Dtype, rng: np.random.Generator) -> LayerExperts:
    projs = []
    for out, inp in ((INTER, H), (INTER, H), (H, INTER)):
        w = mx.array(rng.standard_normal((E, out, inp)).astype(np.float32) * 0.05)
        if bits:
            q, s, b = mx.quantize(w, group_size=32, bits=bits)
            projs.append(ProjWeights(q, s.astype(dtype), b.astype(dtype), group_size=32, bits=bits, experts=E))
        else:
            projs.append(ProjWeights(w.astype(dtype), experts=E))
    return LayerExperts(*projs)


def _case(bits: int, dtype: mx.Dtype) -> tuple[LayerExperts, mx.array, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(bits + 7)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).reshape(1, N, K)
    x = mx.array(rng.standard_normal((1, N, H)).astype(np.float32)).astype(dtype)
    w = _experts(bits, dtype, rng)
    full = switch_glu(w, x, mx.array(ids, dtype=mx.uint32))  # the one-pass call (sorted: N*K >= 64)
    return w, x, ids, np.array(full.astype(mx.float32))


# (gather_mm runs float32 only on the CPU)
MODELS = [(0, mx.float32), (4, mx.float32), (4, mx.bfloat16)]


@pytest.mark.parametrize(("bits", "dtype"), MODELS)
def test_a_pairs_row_is_the_same_in_any_call(bits: int, dtype: mx.Dtype) -> None:
    w, x, ids, full = _case(bits, dtype)
    assert ids.size >= EARLY_PAIRS  # the one-pass call sorts its rows
    flat = ids.reshape(-1)
    rows = x.reshape(-1, H)
    want = full.reshape(-1, H)
    rng = np.random.default_rng(0)
    for sub in (np.arange(4), np.arange(4, 16), rng.choice(E, 5, replace=False), np.array([3])):
        pairs = np.flatnonzero(np.isin(flat, sub))
        for order in (pairs, rng.permutation(pairs), pairs[np.argsort(flat[pairs], kind="stable")]):
            y = switch_glu(w, rows[mx.array(order // K)], mx.array(flat[order][:, None], dtype=mx.uint32))[:, 0]
            assert np.array_equal(np.array(y.astype(mx.float32)), want[order]), (sub, order.size)


@pytest.mark.parametrize(("bits", "dtype"), MODELS)
@pytest.mark.parametrize("groups", [[range(0, 8), range(8, 16)], [range(0, 3), range(3, 10), range(10, 16)]])
def test_expert_major_parts_give_the_one_pass_output_bit_for_bit(bits: int, dtype: mx.Dtype,
                                                                 groups: list[range]) -> None:
    w, x, ids, full = _case(bits, dtype)
    part_of = np.zeros(E, dtype=np.int64)
    for p, g in enumerate(groups):
        part_of[list(g)] = p
    grants = [PartGrant(0, N, np.where(part_of[ids.reshape(N, K)] == p, ids.reshape(N, K), -1), p == len(groups) - 1,
                        by_expert=True) for p in range(len(groups))]
    gen = run_parts(native_run(w), x, ids, grants[0])
    assert isinstance(next(gen), PartDone)
    for g in grants[1:-1]:
        assert isinstance(gen.send(g), PartDone)
    with pytest.raises(StopIteration) as stop:
        gen.send(grants[-1])
    got = stop.value.value
    assert got.shape == (1, N, K, H)
    assert np.array_equal(np.array(got.astype(mx.float32)), full)
