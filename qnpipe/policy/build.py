"""The pool policy a configuration asks for: slot tables, evictions, side region and prefetch budgets."""

from __future__ import annotations

from qnpipe.config import Config, PrefetchInto
from qnpipe.errors import ConfigError
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.heat import Heat
from qnpipe.policy.pool import PoolOptions, PoolPolicy, PrefetchBudgets


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


__all__ = ["check_placement", "make_policy", "side_slots"]
