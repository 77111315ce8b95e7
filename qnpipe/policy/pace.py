"""The forward's layer pace: a running estimate of one MoE layer's time, and the prefetch deadlines it gives."""

from __future__ import annotations

import attrs


@attrs.define(slots=True)
class Pace:
    """`observe(now)` at each MoE router; `deadline(now, here, target)`: when the forward should reach `target`."""

    moe_order: dict[int, int]  # MoE layer -> its index among MoE layers
    layer_step_s: float = 0.0
    last_t: float | None = None

    def new_step(self) -> None:
        self.last_t = None  # the gap across a step's head and sampling is not a layer's time

    def observe(self, now: float) -> None:
        if self.last_t is not None:
            dt = now - self.last_t
            self.layer_step_s = dt if not self.layer_step_s else 0.8 * self.layer_step_s + 0.2 * dt
        self.last_t = now

    def deadline(self, now: float, layer: int, target: int) -> float:
        here = self.moe_order.get(layer, 0)
        return now + (self.moe_order.get(target, here + 1) - here) * self.layer_step_s


__all__ = ["Pace"]
