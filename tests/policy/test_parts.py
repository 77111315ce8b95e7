"""plan_parts (qnpipe/policy/parts.py): token ranges whose expert unions fit the layer's slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe.errors import CapacityError
from qnpipe.policy.parts import plan_parts
from tests.profiles import examples


@st.composite
def routes(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    k = draw(st.integers(1, 4))
    n_experts = draw(st.integers(k, 16))
    n = draw(st.integers(0, 40))
    rows = draw(st.lists(st.lists(st.integers(0, n_experts - 1), min_size=k, max_size=k, unique=True),
                         min_size=n, max_size=n))
    capacity = draw(st.integers(k, n_experts + 2))
    return np.array(rows, dtype=np.int64).reshape(n, k), capacity


# more: a pure function, cheap, with a wide input space
@examples(200)
@given(routes())
def test_parts_cover_tokens_and_fit(route: tuple[np.ndarray, int]) -> None:
    ids, capacity = route
    n = ids.shape[0]
    parts = plan_parts(ids, capacity, layer=3)
    assert parts
    # contiguous, in order, every token in exactly one part
    assert parts[0][0] == 0 and parts[-1][1] == n
    for (_, hi, _), (lo, _, _) in zip(parts, parts[1:], strict=False):
        assert hi == lo
    covered = [t for lo, hi, _ in parts for t in range(lo, hi)]
    assert covered == list(range(n))
    for lo, hi, experts in parts:
        assert hi > lo or n == 0
        assert len(experts) <= capacity
        assert list(experts) == sorted(set(experts))
        assert set(experts) == {int(e) for e in ids[lo:hi].ravel()}  # exactly its tokens' experts
    # greedy: the next token would not have fitted in the part before it
    for (_lo, hi, experts), _ in zip(parts, parts[1:], strict=False):
        assert len(set(experts) | {int(e) for e in ids[hi]}) > capacity
    # one part when the whole union fits
    if len(np.unique(ids)) <= capacity:
        assert len(parts) == 1


@given(k=st.integers(2, 6), data=st.data())
def test_capacity_error_when_a_token_needs_more_than_capacity(k: int, data: st.DataObject) -> None:
    capacity = data.draw(st.integers(1, k - 1))
    ids = np.arange(3 * k, dtype=np.int64).reshape(3, k)
    with pytest.raises(CapacityError):
        plan_parts(ids, capacity)


def test_single_part_example() -> None:
    ids = np.array([[0, 1], [1, 2], [2, 0]])
    assert plan_parts(ids, 3) == [(0, 3, (0, 1, 2))]
    assert plan_parts(ids, 2) == [(0, 1, (0, 1)), (1, 2, (1, 2)), (2, 3, (0, 2))]
