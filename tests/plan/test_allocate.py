"""The slot allocation is the best the curves allow (brute force on small cases), so never below uniform."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from qnpipe.plan.allocate import Allocator, curve_hits, uniform_caps
from tests.profiles import examples

LO = 2


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    n = draw(st.integers(1, 4))
    width = draw(st.integers(1, 5))
    # Any curves: not concave, not even monotone (LRU's need not be).
    curves = [draw(st.lists(st.integers(-20, 20), min_size=width, max_size=width)) for _ in range(n)]
    total = draw(st.integers(LO * n, (LO + width - 1) * n + 2))
    return curves, total


# fewer: the optimum is found by brute force
@examples(60)
@given(cases())
def test_allocation_is_optimal_and_never_below_uniform(case: tuple[list[list[int]], int]) -> None:
    curves, total = case
    a = Allocator(curves, LO, total)
    caps = a.caps(total)
    assert sum(caps) <= total and all(LO <= c < LO + len(h) for c, h in zip(caps, curves, strict=True))
    assert curve_hits(curves, LO, caps) == a.hits(total)
    ranges = [range(LO, LO + len(h)) for h in curves]
    brute = max(curve_hits(curves, LO, list(c)) for c in itertools.product(*ranges) if sum(c) <= total)
    assert a.hits(total) == brute
    hi = LO + len(curves[0]) - 1
    uni = uniform_caps(len(curves), min(total, hi * len(curves)), LO, hi)
    assert a.hits(total) >= curve_hits(curves, LO, uni)


def test_one_pass_serves_every_total() -> None:
    curves = [[0, 5, 6, 6], [0, 1, 2, 10]]  # the second is convex: greedy by marginal gain would starve it
    a = Allocator(curves, LO, 100)
    assert a.caps(4) == [2, 2]
    assert a.caps(5) == [3, 2]
    assert a.caps(7) == [2, 5]  # 0 + 10 beats 5 + 2 and 6 + 1
    assert a.caps(8) == [3, 5]
    assert a.caps(100) == [4, 5]  # not [5, 5]: no slot where it saves nothing


def test_slots_past_a_curves_maximum_are_never_tabled() -> None:
    """Issue 34: a short log of 300 layers x 4096 experts planned for minutes (a table as wide as every slot of
    every layer, for each of every layer's points). A slot past a curve's first maximum never gains, so the
    table ends there, and the allocation is the same."""
    flat = [0, 3, 7] + [7] * 4093
    a = Allocator([flat] * 300, LO, 300 * (LO + len(flat) - 1))
    assert a.max_total == 300 * (LO + 2)
    assert a.caps(10**9) == [LO + 2] * 300 and a.hits(10**9) == 300 * 7
