"""`qnpipe plan --plot`: predicted tok/s and hit rate against the budget, and the chosen capacities per layer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qnpipe.plan.plan_file import Candidate, Plan


def _pick(p: Plan, allocation: str) -> Candidate:
    same = [c for c in p.candidates if c.allocation == allocation and c.evict_policy == p.evict_policy
            and not c.prefetch]
    return same[0] if same else p.candidates[0]


def plot_plans(plans: Sequence[Plan], chosen: Plan, path: str | Path) -> Path:
    """Three panels: hit rate (planned, uniform, Belady at the planned allocation) and replayed tok/s
    (planned, uniform, the chosen) against the budget, and `chosen`'s slots per layer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from qnpipe.io.figure import format_of, save

    gib = [p.memory_bytes / 2**30 for p in plans]
    fig = Figure(figsize=(15, 4.2))
    FigureCanvasAgg(fig)
    a, b, c = fig.subplots(1, 3)
    a.plot(gib, [_pick(p, "planned").hit_rate for p in plans], "o-", label="planned allocation (replay)")
    a.plot(gib, [_pick(p, "uniform").hit_rate for p in plans], "s--", label="uniform allocation (replay)")
    a.plot(gib, [_pick(p, "planned").belady_hit_rate for p in plans], "k:", label="Belady at the planned slots (curve)")
    a.set_xlabel("memory budget (GiB)")
    a.set_ylabel("hit rate")
    a.legend(fontsize=8)
    b.plot(gib, [p.predicted_tok_s for p in plans], "o-", label="plan (chosen)")
    b.plot(gib, [_pick(p, "uniform").tok_s for p in plans], "s--", label="uniform allocation")
    b.set_xlabel("memory budget (GiB)")
    b.set_ylabel("predicted tok/s (replay)")
    b.legend(fontsize=8)
    layers = sorted(chosen.capacities)
    c.bar(layers, [chosen.capacities[x] for x in layers])
    c.set_xlabel("MoE layer")
    c.set_ylabel("resident slots")
    c.set_title(f"{chosen.memory_bytes / 2**30:.2f} GiB: {chosen.evict_policy}, "
                f"prefetch {'on' if chosen.prefetch else 'off'}", fontsize=9)
    fig.suptitle(f"qnpipe plan: {Path(chosen.model).name}, log {Path(chosen.log).name}", fontsize=10)
    fig.tight_layout()
    return save(fig, path, format_of(path))


__all__ = ["plot_plans"]
