"""The generic tier's router finder: a family's router applied to its own layer's switch input picks the
experts the switch was called with (so, on an earlier layer's input, it predicts as the family routes)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from qnpipe.model.family import tiny
from qnpipe.model.family.routers import NO_PREDICTIONS, FamilyPredictor, family_routers
from qnpipe.model.family.switches import find_switches
from qnpipe.steps import PredictPlan

# Routers that rank as the family routes (softmax of logits, or the family's own gate module).
EXACT = ["qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_5_moe", "deepseek_v3", "mixtral", "qwen3_next", "dots1",
         "bailing_moe", "olmoe", "qwen2_moe"]


class Spy(nn.Module):
    _inner: nn.Module
    _seen: list[Any]

    def __init__(self, inner: nn.Module, seen: list[Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_seen", seen)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self._seen.append((x, indices))
        return self._inner(x, indices)


@pytest.mark.parametrize("family", EXACT)
def test_a_router_on_its_own_switch_input_picks_the_switch_experts(family: str) -> None:
    model = tiny.build_random(tiny.tiny_config(family))
    sites = find_switches(model)
    routers, why = family_routers(family, {s.layer: s.parent for s in sites})
    assert why is None and set(routers) == {s.layer for s in sites}
    seen: dict[int, list[Any]] = {s.layer: [] for s in sites}
    for s in sites:
        s.replace(Spy(s.module, seen[s.layer]))
    model(mx.array(np.random.default_rng(0).integers(0, 200, 9))[None])
    k = tiny.top_k(tiny.tiny_config(family))
    for layer, [(x, indices)] in seen.items():
        ids, scores = routers[layer](x, k)
        mx.eval(ids, scores)
        got = np.sort(np.array(ids).reshape(-1, ids.shape[-1]), axis=-1)
        want = np.sort(np.array(indices).reshape(-1, indices.shape[-1]), axis=-1)
        assert np.array_equal(got, want), (family, layer)


def test_families_without_a_usable_router_input_get_none_with_a_reason() -> None:
    model = tiny.build_random(tiny.tiny_config("llama4"))
    routers, why = family_routers("llama4", {s.layer: s.parent for s in find_switches(model)})
    assert routers == {} and why == NO_PREDICTIONS["llama4"]


def test_the_predictor_answers_for_each_target_of_the_plan() -> None:
    model = tiny.build_random(tiny.tiny_config("qwen3_moe"))
    sites = find_switches(model)
    routers, _ = family_routers("qwen3_moe", {s.layer: s.parent for s in sites})
    layers = sorted(routers)
    plan = PredictPlan({layers[0]: (layers[1],)}, 6, True)
    preds = FamilyPredictor(plan, routers)(layers[0], mx.ones((1, 3, 64)))
    assert [(t, ids.shape, p.shape) for t, ids, p in preds] == [(layers[1], (1, 3, 6), (1, 3, 6))]
    assert FamilyPredictor(plan, routers)(layers[1], mx.ones((1, 3, 64))) == []
