"""The pool policy a configuration asks for: slot tables, evictions, side region and prefetch budgets."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Protocol

from qnpipe.config import Config, PrefetchInto
from qnpipe.errors import ConfigError
from qnpipe.files import CONFIG_CAP, read_capped
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.heat import Heat
from qnpipe.policy.pool import PoolOptions, PoolPolicy, PrefetchBudgets


class ExpertShape(Protocol):
    """What `layer_capacities` reads of a model: a ModelArgs, or replay's view of a log's ModelShape."""

    @property
    def moe_layers(self) -> Sequence[int]: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...


def parse_capacity_profile(path: str, data: bytes | str) -> dict[int, int]:
    """The `layer_caps` of a capacity profile's contents `data` (read from `path`); ConfigError when it is not one."""
    try:
        raw = json.loads(data)
        return {int(k): int(v) for k, v in raw["layer_caps"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"pool.capacity_profile_path={path}: not a capacity profile "
                          f'{{"layer_caps": {{"0": n, ...}}}} ({e})') from None


def read_capacity_profile(path: str) -> dict[int, int]:
    """`parse_capacity_profile` of the file at `path` (capped, a regular file only: a FIFO cannot block)."""
    try:
        data = read_capped(path, CONFIG_CAP, error=OSError)
    except OSError as e:
        raise ConfigError(f"pool.capacity_profile_path={path}: not a capacity profile "
                          f'{{"layer_caps": {{"0": n, ...}}}} ({e})') from None
    return parse_capacity_profile(path, data)


def layer_capacities(cfg: Config, args: ExpertShape, *, profile: Mapping[int, int] | None = None) -> dict[int, int]:
    """Slots per MoE layer: `pool.expert_slots`, or the profile file's `layer_caps`, at most every expert.

    `profile`: the profile's `layer_caps` when the caller has read it already (`read_capacity_profile`).
    Raises ConfigError for an unreadable profile or a capacity below top-k, naming the layer.
    """
    caps = {layer: cfg.pool.expert_slots for layer in args.moe_layers}
    path = cfg.pool.capacity_profile_path
    if path:
        given = profile if profile is not None else read_capacity_profile(path)
        for layer, cap in given.items():
            if layer in caps:
                caps[layer] = cap
    out = {}
    for layer, cap in caps.items():
        if cap < args.num_experts_per_tok:
            where = f"pool.capacity_profile_path={path}" if path else f"pool.expert_slots={cfg.pool.expert_slots}"
            raise ConfigError(f"{where}: layer {layer} gets {cap} slots, below the model's top-k "
                              f"({args.num_experts_per_tok} experts per token)")
        out[layer] = min(cap, args.num_experts)
    return out


def side_slots(cfg: Config) -> int:
    """Side-region slots per layer: `pool.side_region_slots` when prefetch is on, else none (nothing lands there)."""
    return cfg.pool.side_region_slots if cfg.predict.cross_layer_prefetch else 0


def check_placement(cfg: Config) -> None:
    """ConfigError when prefetch is on with nowhere to land: no side slot and pool.prefetch_into=side."""
    if (cfg.predict.cross_layer_prefetch and cfg.pool.side_region_slots == 0
            and cfg.pool.prefetch_into is PrefetchInto.SIDE):
        raise ConfigError("predict.cross_layer_prefetch=true with pool.side_region_slots=0 and "
                          "pool.prefetch_into=side: prefetches would have nowhere to land; give the side region "
                          "slots or set pool.prefetch_into=main")


def make_policy(cfg: Config, capacities: dict[int, int], record_nbytes: dict[int, int],
                heat: Heat | None = None) -> PoolPolicy:
    evictions = {layer: make_eviction(cfg.pool.evict_policy, cap,
                                      lfu_decay_interval=cfg.pool.lfu_decay_interval_forwards,
                                      lrfu_lambda=cfg.pool.lrfu_lambda, watchdog_s=cfg.diag.watchdog_s)
                 for layer, cap in capacities.items()}
    check_placement(cfg)
    # The side region keeps its hot prefetched experts by LFU (side_region_lfu) or is cleared each step.
    options = PoolOptions(
        predicting=cfg.predict.cross_layer_prefetch, side_slots=side_slots(cfg),
        into_main=cfg.predict.cross_layer_prefetch and cfg.pool.prefetch_into is PrefetchInto.MAIN,
        side_persistent=cfg.pool.side_region_lfu,
        budgets=PrefetchBudgets(per_layer=cfg.predict.per_layer_budget_experts or 10**9,
                                global_reads=cfg.predict.file_global_budget_experts or 10**9,
                                global_unused=cfg.predict.stage_global_budget_experts or 10**9,
                                per_hint=cfg.read.prefetch_budget_experts, window_layers=cfg.read.window_layers),
        recall_prof=cfg.diag.predict_recall_prof)
    return PoolPolicy.build(capacities, evictions, record_nbytes, options, heat)


__all__ = ["ExpertShape", "check_placement", "layer_capacities", "make_policy", "parse_capacity_profile",
           "read_capacity_profile", "side_slots"]
