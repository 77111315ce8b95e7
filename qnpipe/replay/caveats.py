"""Warnings a replay report carries beside numbers that would otherwise mislead.

A layer the log never routes through would show 0 hits of 0 (hit rate 0.000) and drag a
mean over layers down; a capacity above the expert count is clamped to it, so the run
measured fewer slots than asked for; a prefetch budget below top-k caps what prediction can
cover however good the predictor is; a predictor that issued no read on the log (one MoE layer: no
next layer to hint; `previous` on one-token steps: it names what is resident already) leaves every
side-region hit to the victim region. Each becomes one sentence naming the setting and its value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


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
                   "they are left out of the per-layer table and of every total, not counted as 0 hits; "
                   f"memory_bytes and steps/s (tok_s) are those of the log's {_layers(moe - len(absent))} alone "
                   "(their slots, their compute and reads), not the whole model's")
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
        if predictor == "transition" and cfg.predict.width_experts > num:  # the one replay predictor it shapes
            out.append(f"predict.width_experts={cfg.predict.width_experts} is above the model's {num} experts: "
                       f"clamped to {num} (a hint names every expert, so most prefetch reads cannot be used)")
        if predictor == "transition" and cfg.predict.width_experts < k:
            out.append(f"predict.width_experts={cfg.predict.width_experts} is below the model's top-k ({k}): "
                       "a hint names fewer experts than a token routes to")
    return out


def no_prefetch(predictor: str, routed: Iterable[int], issued: int, steps: Sequence[Sequence[tuple[int, Sequence[int]]]],
                top_k: int, *, into_main: bool = False) -> list[str]:
    """A warning when `predictor` issued no prefetch read in the run (`issued`), with the reason when it is the
    log's shape: one MoE layer (a hint names the next MoE layer: there is none), or `previous` on one-token
    steps (it names the previous step's experts, used at that layer a step ago and so resident already)."""
    if issued:
        return []
    if len(set(routed)) < 2:
        why = "the log routes through one MoE layer, and a prediction names the next MoE layer: there is none"
    elif predictor == "previous" and all(len(ex) <= top_k for step in steps for _, ex in step):
        why = ("every step is one token, and `previous` names the previous step's experts of the next layer, "
               "resident already")
    else:
        why = "every expert it named was in memory already or over a budget"
    victims = ("; any hit beyond the resident slots is the victim region's (pool.prefetch_into=main), not "
               "prediction's") if into_main else ""
    return [f"predictor {predictor!r} issued no prefetch read on this log ({why}): 0 prefetch hits{victims}"]


__all__ = ["absent_layers", "no_prefetch", "spans", "warnings"]
