"""The prefill chunk's choice (qnpipe.policy.prefill): bytes read per prompt token never rise with the
chunk, the longest chunk that fits a budget is taken, and the engine's default is one chunk for
every pool (so logits stay bit-identical across memory budgets)."""

from __future__ import annotations

import pytest

from qnpipe import config
from qnpipe.policy.prefill import DEFAULT_CHUNK, bytes_per_prompt_token, expected_union, longest_fitting_chunk


def test_the_default_chunk_is_mlx_lms_step_and_the_configs() -> None:
    assert DEFAULT_CHUNK == 512
    assert config.load().forward.prefill_chunk_tokens == DEFAULT_CHUNK


@pytest.mark.parametrize(("experts", "top_k", "capacity"), [(128, 8, 32), (128, 8, 128), (512, 10, 64), (64, 4, 4)])
def test_bytes_per_prompt_token_never_rise_with_the_chunk(experts: int, top_k: int, capacity: int) -> None:
    shape = {"experts": experts, "top_k": top_k, "capacity": capacity, "record_bytes": 1000, "layers": 2}
    costs = [bytes_per_prompt_token(t, **shape) for t in (1, 2, 4, 16, 64, 256, 1024, 2048, 8192)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(costs, costs[1:], strict=False)), costs
    if capacity == experts:  # every expert fits: read once a chunk, so 1/T once the union saturates
        assert costs[-1] == pytest.approx(2 * 1000 * experts / 8192, rel=1e-3)


def test_expected_union_saturates_at_the_layers_experts() -> None:
    assert expected_union(1, 128, 8) == pytest.approx(8)
    assert expected_union(2048, 128, 8) == pytest.approx(128)
    assert expected_union(0, 128, 8) == 0


def test_the_longest_chunk_that_fits_the_budget() -> None:
    per_token = 1000
    assert longest_fitting_chunk(lambda t: t * per_token, 10**9) == DEFAULT_CHUNK
    assert longest_fitting_chunk(lambda t: t * per_token, 300 * per_token) == 256
    assert longest_fitting_chunk(lambda t: t * per_token, 10) == 1  # nothing fits: the planner refuses
    assert longest_fitting_chunk(lambda t: t * per_token, 3000 * per_token, longest=3000) == 3000


def test_a_made_up_rising_cost_would_be_caught() -> None:
    """The monotonicity check above fails on a cost that rises with the chunk (shown on a made-up one)."""
    costs = [bytes_per_prompt_token(t, experts=128, top_k=8, capacity=128, record_bytes=1, layers=1) * t
             for t in (1, 64, 2048)]  # bytes per chunk, not per token: rises
    assert not all(b <= a for a, b in zip(costs, costs[1:], strict=False))
