"""Warnings a replay report carries beside numbers that would otherwise mislead.

A layer the log never routes through would show 0 hits of 0 (hit rate 0.000) and drag a
mean over layers down; a capacity above the expert count is clamped to it, so the run
measured fewer slots than asked for; a prefetch budget below top-k caps what prediction can
cover however good the predictor is. Each becomes one sentence naming the setting and its value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qnpipe.config import Config
from qnpipe.policy.build import read_capacity_profile
from qnpipe.trace import ModelShape


def spans(layers: Iterable[int]) -> str:
    """Sorted layer numbers as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out: list[str] = []
    run: list[int] = []
    for x in sorted(layers):
        if run and x == run[-1] + 1:
            run.append(x)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [x]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def absent_layers(shape: ModelShape, routed: Iterable[int]) -> list[int]:
    """The model's MoE layers with no route among `routed` (a log of some layers only)."""
    return sorted(set(shape.moe_layers) - set(routed))


def _asked(cfg: Config, shape: ModelShape, profile: Mapping[int, int] | None) -> dict[int, int]:
    """Slots per MoE layer as the config asks for them, before `layer_capacities` clamps them to the expert count."""
    asked = dict.fromkeys(shape.moe_layers, cfg.pool.expert_slots)
    path = cfg.pool.capacity_profile_path
    if path:
        given = profile if profile is not None else read_capacity_profile(path)
        asked |= {k: v for k, v in given.items() if k in asked}
    return asked


def warnings(cfg: Config, shape: ModelShape, absent: list[int], predictor: str, *,
             profile: Mapping[int, int] | None = None) -> list[str]:
    """The report's warnings (see the module doc), in a fixed order. `profile`: the capacity profile's
    `layer_caps` when the caller has read it (the replay has), else it is read here."""
    out: list[str] = []
    moe = len(shape.moe_layers)
    if absent:
        out.append(f"{len(absent)} of {moe} MoE layers have no route in the log (layers {spans(absent)}): "
                   "they are left out of the per-layer table and of every total, not counted as 0 hits")
    num, k = shape.num_experts, shape.top_k
    over = sorted(layer for layer, cap in _asked(cfg, shape, profile).items() if cap > num)
    if over:
        where = (f"pool.capacity_profile_path={cfg.pool.capacity_profile_path} (layers {spans(over)})"
                 if cfg.pool.capacity_profile_path else f"pool.expert_slots={cfg.pool.expert_slots}")
        out.append(f"{where} is above the model's {num} experts: capacity clamped to {num} slots "
                   f"(every expert fits; the run measured {num} slots, not the number asked for)")
    if predictor != "none":
        budgets = {"predict.per_layer_budget_experts": cfg.predict.per_layer_budget_experts,
                   "predict.file_global_budget_experts": cfg.predict.file_global_budget_experts,
                   "predict.stage_global_budget_experts": cfg.predict.stage_global_budget_experts,
                   "read.prefetch_budget_experts": cfg.read.prefetch_budget_experts or 0}
        for key, v in budgets.items():
            if 0 < v < k:  # 0 = no cap
                out.append(f"{key}={v} is below the model's top-k ({k}): prefetch covers at most {v} of the {k} "
                           "experts a token needs, whatever the predictor's recall")
        side = cfg.pool.side_region_slots
        if side < k and cfg.pool.prefetch_into == "side":  # `main` lands prefetches in the resident slots
            out.append(f"pool.side_region_slots={side} is below the model's top-k ({k}): at most {side} prefetched "
                       "experts per layer can wait for their step, the rest of each hint is dropped")
        if predictor == "transition" and cfg.predict.width_experts < k:
            out.append(f"predict.width_experts={cfg.predict.width_experts} is below the model's top-k ({k}): "
                       "a hint names fewer experts than a token routes to")
    return out


__all__ = ["absent_layers", "spans", "warnings"]
