"""The predictor's ranking: the one-token path agrees with the general one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qnpipe.config import PredictAgg
from qnpipe.policy.predict import rank


@given(experts=st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), data=st.data(),
       agg=st.sampled_from([PredictAgg.MAX, PredictAgg.MEAN]), top=st.integers(1, 12),
       min_score=st.sampled_from([0.0, 0.3]))
def test_one_token_ranks_as_the_same_token_twice(experts: list[int], data: st.DataObject, agg: PredictAgg,
                                                 top: int, min_score: float) -> None:
    # Scores from a small set, so ties (broken by expert id) are common.
    scores = data.draw(st.lists(st.sampled_from([0.1, 0.25, 0.5, 0.9]), min_size=len(experts),
                                max_size=len(experts)))
    w = len(experts)
    one = rank(experts, scores, w, agg=agg, union_k=w, top=top, min_score=min_score)
    twice = rank(experts * 2, scores * 2, w, agg=agg, union_k=w, top=top, min_score=min_score)  # the general path
    assert one == twice
    assert one == sorted(((e, s) for e, s in zip(experts, scores, strict=True) if s >= min_score),
                         key=lambda es: (-es[1], es[0]))[:top]
