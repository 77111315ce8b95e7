"""Cross-layer predictions on the generic tier: a later MoE layer's own router applied to this layer's switch input.

The router of a switch is a child of the block that holds it (families.md §3a, "Router finder"):
1. a gate module that returns `(ids, scores)` (`MoEGate`, `BailingMoeGate`, `Dots1TopkRouter`, ...):
   the family's exact routing, on another input;
2. else an `nn.Linear` (or quantized one) named `gate`, `router` or `classifier`: its logits, ranked by
   the softmax, as the native predictor does (`qnpipe.model.stepper._predict`).

Families whose switch input is not what a later router would see (`registry.NO_PREDICTIONS`: llama4
scales it by the router's score, nemotron_h and kimi_k3 project it to a latent, ...) get none; the
engine says so once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from qnpipe.model.family.registry import NO_PREDICTIONS
from qnpipe.steps import PredictPlan

ROUTER_NAMES = ("gate", "router", "classifier")
# x [..., H], width -> (ids [..., w], scores [..., w]), lazy.
Router = Callable[[mx.array, int], tuple[mx.array, mx.array]]


def find_router(block: Any) -> Router | None:
    """The router of the MoE block `block` (the module holding a switch), or None."""
    if not isinstance(block, nn.Module):
        return None
    for name in ROUTER_NAMES:
        m = block.get(name)
        if isinstance(m, nn.Linear | nn.QuantizedLinear):
            return _linear(m)
        if isinstance(m, nn.Module) and callable(m):
            return _gate(m)
    return None


def _linear(lin: nn.Module) -> Router:
    def route(x: mx.array, width: int) -> tuple[mx.array, mx.array]:
        probs = mx.softmax(lin(x).astype(mx.float32), axis=-1, precise=True)
        w = min(width, probs.shape[-1])
        ids = mx.argpartition(probs, kth=-w, axis=-1)[..., -w:]
        return ids, mx.take_along_axis(probs, ids, axis=-1)

    return route


def _gate(gate: nn.Module) -> Router:
    """A gate module: `(ids, scores)` as the family routes (width is the family's top-k), or logits."""
    linear = _linear(gate)

    def route(x: mx.array, width: int) -> tuple[mx.array, mx.array]:
        out = gate(x)
        if isinstance(out, tuple | list) and len(out) == 2:
            a, b = out
            ids, scores = (a, b) if mx.issubdtype(a.dtype, mx.integer) else (b, a)
            return ids, scores.astype(mx.float32)
        return linear(x, width)

    return route


class FamilyPredictor:
    """The predictions of one MoE layer-step: for each target of `plan`, its router on this layer's switch input."""

    def __init__(self, plan: PredictPlan, routers: Mapping[int, Router]) -> None:
        self.plan = plan
        self.routers = dict(routers)

    def __call__(self, layer: int, x: mx.array) -> list[tuple[int, mx.array, mx.array]]:
        """(target, ids, scores) per target layer, lazy: evaluate them with the layer's router ids."""
        out = []
        for t in self.plan.targets.get(layer, ()):
            route = self.routers.get(t)
            if route is not None:
                ids, scores = route(x, self.plan.width)
                out.append((t, ids, scores))
        return out


def family_routers(model_type: str, blocks: Mapping[int, Any]) -> tuple[dict[int, Router], str | None]:
    """Routers per MoE layer (`blocks`: layer -> the module holding its switch), and why some layer has
    none (None when every layer has one)."""
    if model_type in NO_PREDICTIONS:
        return {}, NO_PREDICTIONS[model_type]
    routers = {layer: r for layer, b in blocks.items() if (r := find_router(b)) is not None}
    missing = sorted(set(blocks) - set(routers))
    return routers, (f"no router found beside the switch of layer(s) {missing}" if missing else None)
