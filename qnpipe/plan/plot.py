"""`qnpipe plan --plot`: predicted tok/s and hit rate against the budget, and the chosen capacities per layer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from qnpipe.io.figure import (
    DEFAULT_OPTIONS,
    FigureOptions,
    describe_cost,
    describe_device,
    finish,
    format_of,
    provenance,
    save,
)
from qnpipe.plan.plan_file import Candidate, Plan


def _pick(p: Plan, allocation: str) -> Candidate:
    same = [c for c in p.candidates if c.allocation == allocation and c.evict_policy == p.evict_policy
            and not c.prefetch]
    return same[0] if same else p.candidates[0]


def plot_plans(plans: Sequence[Plan], chosen: Plan, path: str | Path, opts: FigureOptions = DEFAULT_OPTIONS) -> Path:
    """Three panels: hit rate (planned, uniform, Belady at the planned allocation) and replayed tok/s
    (planned, uniform, the chosen) against the budget, each with the requested budget (`chosen`'s) marked,
    and `chosen`'s slots per layer; a provenance line names the device profile and cost model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gib = [p.memory_bytes / 2**30 for p in plans]
    asked = chosen.memory_bytes / 2**30
    fig = Figure(figsize=opts.figsize((15, 4.6)), layout="constrained")
    FigureCanvasAgg(fig)
    a, b, c = fig.subplots(1, 3)
    a.plot(gib, [_pick(p, "planned").hit_rate for p in plans], "o-", label="planned allocation (replay)")
    a.plot(gib, [_pick(p, "uniform").hit_rate for p in plans], "s--", label="uniform allocation (replay)")
    a.plot(gib, [_pick(p, "planned").belady_hit_rate for p in plans], "k:", label="Belady at the planned slots (curve)")
    a.set_ylabel("hit rate (fraction of expert requests)")
    b.plot(gib, [p.predicted_tok_s for p in plans], "o-", label="plan (chosen)")
    b.plot(gib, [_pick(p, "uniform").tok_s for p in plans], "s--", label="uniform allocation")
    b.set_ylabel("predicted tok/s (replay)")
    for ax in (a, b):
        ax.axvline(asked, color="0.3", linewidth=1.0, linestyle="-.", label=f"requested budget ({asked:.2f} GiB)")
        ax.set_xlabel(opts.xlabel or "memory budget (GiB)")
        ax.set_ylim(bottom=0.0)  # a few % between budgets is not drawn as a cliff
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if opts.ylabel is not None:
        a.set_ylabel(opts.ylabel)
    layers = sorted(chosen.capacities)
    c.bar(layers, [chosen.capacities[x] for x in layers])
    c.set_xlabel("MoE layer")
    c.set_ylabel("resident slots")
    c.set_title(f"at the requested {asked:.2f} GiB: {chosen.evict_policy}, "
                f"prefetch {'on' if chosen.prefetch else 'off'}", fontsize=9)
    fig.suptitle(opts.title or f"qnpipe plan: {Path(chosen.model).name}", fontsize=10)
    line = provenance(log=chosen.log + (" (synthetic)" if chosen.log_synthetic else ""),
                      device=f"{chosen.device_name} ({describe_device(chosen.device)})", cost=describe_cost(chosen.cost))
    finish(fig, None, msgspec.structs.replace(opts, title=None), line)
    return save(fig, path, format_of(path), dpi=opts.dpi)


__all__ = ["plot_plans"]
