"""The caps on speculation: which prefetches a hint may still issue (`PrefetchGate`)."""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class PrefetchBudgets:
    """Caps on speculation (0 or None = no cap where noted)."""

    per_layer: int = 4  # prefetches issued per (step, target layer)
    global_reads: int = 64  # prefetch reads issued and not finished, all layers
    # prefetches issued during the current forward step and not used yet, all layers; older
    # unused ones are just cached side-region entries and do not count (they would fill it for good)
    global_unused: int = 64
    per_hint: int | None = None  # read.prefetch_budget_experts
    window_layers: int = 0  # targets more than this many MoE layers ahead are dropped (0 = no limit)


@attrs.define
class PrefetchGate:
    """The budgets and what counts against them: prefetches issued per (step, layer) this forward step
    and prefetch reads not finished (`reads_out`); `moe_order` gives how far ahead a target is."""

    budgets: PrefetchBudgets
    moe_order: dict[int, int]  # layer -> its index among MoE layers
    issued_per_step: dict[tuple[int, int], int] = attrs.field(factory=dict)
    reads_out: int = 0

    def ahead(self, source: int, layer: int) -> int:
        """MoE layers from the hint's `source` to its target `layer`."""
        return self.moe_order[layer] - self.moe_order.get(source, -1)

    def over(self, step: int, layer: int, ahead: int, step_unused: int, this_hint: int) -> bool:
        """True when one more prefetch for `layer` would break a budget; `step_unused`: prefetches of this
        forward step not used yet, `this_hint`: those the current hint issued already."""
        b = self.budgets
        return bool((b.window_layers and ahead > b.window_layers)
                    or self.issued_per_step.get((step, layer), 0) >= b.per_layer
                    or self.reads_out >= b.global_reads
                    or step_unused >= b.global_unused
                    or (b.per_hint is not None and this_hint >= b.per_hint))

    def issued(self, step: int, layer: int) -> None:
        key = (step, layer)
        self.issued_per_step[key] = self.issued_per_step.get(key, 0) + 1
        self.reads_out += 1

    def forward_done(self) -> None:
        self.issued_per_step.clear()


__all__ = ["PrefetchBudgets", "PrefetchGate"]
