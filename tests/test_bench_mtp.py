"""tools/bench_mtp.py's limit of speculation: the free-drafter bound from its measured figures."""

from __future__ import annotations

import pytest

from tests.tool_module import load_tool


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_mtp.py")


@pytest.mark.slow
def test_the_bound_is_the_accept_length_over_the_verify_cost(bench) -> None:
    # Plain decode at 200 tok/s (5 ms a token); verifies of 2..5 positions take 7.5, 10, 12.5, 15 ms.
    rb = {"plain": 200.0, "verify2": 0.0075, "verify3": 0.010, "verify4": 0.0125, "verify5": 0.015}
    got = bench._bounds(rb, {"k1": 1.8, "k2": 2.6, "k3": 3.0, "adaptive": 2.5}, best=1.04)
    assert got["verify_cost"] == {"2": 1.5, "3": 2.0, "4": 2.5, "5": 3.0}
    assert got["speedup_bound"] == {"k1": 1.2, "k2": 1.3, "k3": 1.2}  # k4 not run: no bound for it
    assert got["speedup_bound_max"] == 1.3
    assert got["ratio_best_to_bound"] == pytest.approx(0.8)
