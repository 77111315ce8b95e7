"""Capacity invariance with prediction and prefetch: every setting gives the all-resident logits, bit for bit.

Prediction on and off, every aggregate, side region persistent and cleared per step,
tiny and huge budgets, prefetches into the side region and into the resident one
(pool.prefetch_into), with route verification on; misses always have exactly one cause.
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
# Both placements (pool.prefetch_into): each prefetch setting again with prefetches in the resident region
# (relabelled slots between the regions), and main with no side region at all.
SETTINGS += [{**s, "pool.prefetch_into": "main"} for s in SETTINGS if s.get("predict.cross_layer_prefetch")]
SETTINGS.append({"predict.cross_layer_prefetch": True, "pool.prefetch_into": "main", "pool.side_region_slots": 0})


@pytest.mark.slow
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
    assert on.prefetch_hits > 0 and on.prefetch_hits + on.victim_hits == on.side_hits
    assert on.misses < off.misses  # the trained model's routing is predictable from the layer before
    assert 0 < on.useful_prefetch_ratio <= 1


def test_the_victim_regions_hits_are_not_credited_to_prefetch(streamed_models: dict[str, Path]) -> None:
    # pool.prefetch_into=main: prefetches land in the resident slots and the side region keeps what those
    # slots gave up (a victim cache): its hits are the victim region's, not a prefetch's.
    over = {"pool.prefetch_into": "main", "pool.side_region_slots": 4, "predict.cross_layer_prefetch": True}
    with qnpipe.Engine(streamed_models["trained-4bit"], expert_slots=6, **over) as eng:
        eng.generate(PROMPT, max_tokens=24, stop_at_eos=False)
        st = eng.stats().pool
    assert st is not None
    assert st.prefetch_hits + st.victim_hits == st.side_hits
    assert st.victim_hits > 0 and st.prefetch_hits <= st.prefetch_used


def test_event_log_orders_hint_read_grant_and_profiles_unions_and_recall(streamed_models: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    from qnpipe import trace
    from qnpipe.messages import Granted, PrefetchHint, ReadDone, ReadExpert
    from qnpipe.policy.read_queue import ReadClass

    log = tmp_path / "run.qntrace"
    over: dict[str, Any] = {"predict.cross_layer_prefetch": True, "pool.side_region_slots": 16,
                            "diag.union_prof": True, "diag.predict_recall_prof": True,
                            "trace.event_log_path": str(log)}
    with qnpipe.Engine(streamed_models["trained-4bit"], expert_slots=6, **over) as eng:
        eng.generate(PROMPT, max_tokens=12, stop_at_eos=False)
        st = eng.stats().pool
    assert st is not None and st.union_prof
    k = 4
    assert all(1 <= u.mean_union <= u.max_union <= u.tokens * k for u in st.union_prof)
    assert {u.tokens for u in st.union_prof} >= {1}  # decode steps are one token long
    assert any(layer.prefetch_recall > 0 for layer in st.layers)
    _, records = trace.read(log)
    kinds = {r.__class__.__name__ for r in records}
    assert {"UnionSize", "RecallSample", "PrefetchHint", "Candidates"} <= kinds
    hint_t: dict[tuple[int, int], float] = {}
    read_t: dict[tuple[int, int], float] = {}
    checked = 0
    for r in records:
        if isinstance(r, PrefetchHint):
            for e in r.experts:
                hint_t.setdefault((r.layer, e), r.t)
        elif isinstance(r, ReadExpert) and r.cls is ReadClass.PREFETCH:
            assert (r.layer, r.expert) in hint_t and hint_t[(r.layer, r.expert)] <= r.t  # hint before read
            read_t[(r.layer, r.expert)] = r.t
        elif isinstance(r, ReadDone) and (r.layer, r.expert) in read_t:
            assert read_t[(r.layer, r.expert)] <= r.issued_t <= r.started_t <= r.t
        elif isinstance(r, Granted):
            for e in r.experts:
                if (r.layer, e) in read_t:
                    assert read_t[(r.layer, e)] <= r.t  # the prefetch was issued before the grant that used it
                    checked += 1
    assert checked > 0
