"""plan_parts_by_expert (qnpipe/policy/parts.py): expert-major parts, each expert read once per layer-step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe.errors import CapacityError
from qnpipe.policy.parts import plan_parts_by_expert, plan_parts_flat
from tests.profiles import examples


@st.composite
def routes(draw: st.DrawFn) -> tuple[list[int], int, int, list[int], bool]:
    k = draw(st.integers(1, 4))
    n_experts = draw(st.integers(k, 24))
    n = draw(st.integers(1, 40))
    rows = draw(st.lists(st.lists(st.integers(0, n_experts - 1), min_size=k, max_size=k, unique=True),
                         min_size=n, max_size=n))
    capacity = draw(st.integers(k, n_experts + 2))
    first = draw(st.lists(st.integers(0, n_experts - 1), max_size=capacity, unique=True))
    return [e for r in rows for e in r], k, capacity, first, draw(st.booleans())


@examples(200)
@given(routes())
def test_each_expert_in_one_part_that_fits_and_every_pair_counted(route: tuple[list[int], int, int, list[int],
                                                                                bool]) -> None:
    experts, k, capacity, first, router = route
    n = len(experts) // k
    parts, pairs = plan_parts_by_expert(experts, k, capacity, layer=2, router_order=router, first=first)
    union = set(experts)
    served = [e for _, _, ex in parts for e in ex]
    assert sorted(served) == sorted(union)  # each expert of the step in exactly one part: read once
    assert all((lo, hi) == (0, n) for lo, hi, _ in parts)  # a part runs the pairs of every token
    assert all(0 < len(ex) <= capacity for _, _, ex in parts)
    assert len(parts) == -(-len(union) // capacity)  # as few parts as the slots allow
    assert len(parts) == 1 or len(parts[-1][2]) == capacity  # the last is full: the next step starts there
    owner = {e: i for i, (_, _, ex) in enumerate(parts) for e in ex}
    assert pairs == [sum(owner[e] == i for e in experts) for i in range(len(parts))]
    if len(parts) == 1:  # the union fits: the token-major plan's one part
        assert parts == plan_parts_flat(experts, k, capacity, router_order=router)
    else:
        for _, _, ex in parts:
            assert list(ex) == (sorted(ex) if not router else [e for e in dict.fromkeys(experts) if e in ex])
        # the experts of `first` that the step names are served first: no part before theirs
        kept = [owner[e] for e in union if e in set(first)]
        rest = [owner[e] for e in union if e not in set(first)]
        assert not kept or not rest or max(kept) <= min(rest)


def test_first_experts_lead_and_the_remainder_part_comes_first() -> None:
    experts = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # 10 tokens of k=1
    parts, pairs = plan_parts_by_expert(experts, 1, 4, first=(8, 9, 5))
    assert [ex for _, _, ex in parts] == [(5, 8), (0, 1, 2, 9), (3, 4, 6, 7)]
    assert pairs == [2, 4, 4]


def test_a_token_needing_more_than_the_capacity_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match="layer 4"):
        plan_parts_by_expert([0, 1, 2], 3, 2, layer=4)
    assert np.array_equal(plan_parts_by_expert([], 2, 2)[1], [0])
