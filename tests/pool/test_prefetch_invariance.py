"""Capacity invariance with prediction and prefetch: every setting gives the all-resident logits, bit for bit.

Prediction on and off, every aggregate, side region persistent and cleared per step,
tiny and huge budgets, with route verification on; misses always have exactly one cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qnpipe

PROMPT = [5, 17, 300, 42, 9, 77, 11, 12, 13]

SETTINGS: list[dict[str, Any]] = [
    {},
    {"predict.cross_layer_prefetch": True},
    {"predict.cross_layer_prefetch": True, "predict.aggregate": "mean", "pool.side_region_slots": 16},
    {"predict.cross_layer_prefetch": True, "predict.aggregate": "union", "predict.union_k": 2,
     "pool.side_region_lfu": False, "pool.side_region_slots": 8},
    # tiny budgets: almost every hint dropped
    {"predict.cross_layer_prefetch": True, "predict.per_layer_budget_experts": 1,
     "predict.file_global_budget_experts": 1, "predict.stage_global_budget_experts": 1, "read.bg_budget_experts": 1},
    # huge budgets, a wide predictor looking far ahead
    {"predict.cross_layer_prefetch": True, "predict.per_layer_budget_experts": 1000,
     "predict.file_global_budget_experts": 1000, "predict.stage_global_budget_experts": 1000,
     "predict.width_experts": 64, "predict.ahead_layers": 4, "pool.side_region_slots": 32, "read.window_layers": 0},
]


@pytest.mark.parametrize("name", ["default-fp32", "default-4bit", "trained-4bit"])
def test_prefetch_settings_equal_all_resident(streamed_models: dict[str, Path], name: str) -> None:
    d = streamed_models[name]
    with qnpipe.Engine(d, eager_load=True) as ref:
        k = ref.args.num_experts_per_tok
        want = ref.logits(PROMPT)
        want_tokens = ref.generate(PROMPT, max_tokens=16, stop_at_eos=False).tokens
    for over in SETTINGS:
        with qnpipe.Engine(d, expert_slots=k + 1, **{"diag.route_verify": True, **over}) as eng:
            got = eng.logits(PROMPT)
            tokens = eng.generate(PROMPT, max_tokens=16, stop_at_eos=False).tokens
            st = eng.stats().pool
        assert st is not None
        assert np.array_equal(got, want), (name, over)
        assert tokens == want_tokens, (name, over)
        assert sum(st.misses_by_cause.values()) == st.misses, (name, over, st.misses_by_cause)
        if over.get("predict.cross_layer_prefetch"):
            assert st.hints > 0 and st.prefetch_recall > 0, over
            assert set(st.misses_by_cause) <= {"cold", "not_predicted", "late", "dropped", "evicted"}
        else:
            assert st.prefetch_issued == 0 and set(st.misses_by_cause) <= {"cold", "capacity"}


def test_prefetch_turns_misses_into_side_hits(streamed_models: dict[str, Path]) -> None:
    d = streamed_models["trained-4bit"]
    base: dict[str, Any] = {"expert_slots": 6}
    with qnpipe.Engine(d, **base) as eng:
        eng.generate(PROMPT, max_tokens=24, stop_at_eos=False)
        off = eng.stats().pool
    with qnpipe.Engine(d, **base, **{"predict.cross_layer_prefetch": True, "pool.side_region_slots": 16,
                                     "predict.per_layer_budget_experts": 16}) as eng:
        eng.generate(PROMPT, max_tokens=24, stop_at_eos=False)
        on = eng.stats().pool
    assert off is not None and on is not None
    assert on.side_hits > 0 and on.prefetch_used > 0
    assert on.misses < off.misses  # the trained model's routing is predictable from the layer before
    assert 0 < on.useful_prefetch_ratio <= 1
