"""The settings a plan sets that the user gave: the planner plans with them fixed or refuses, never overrides them.

A plan sets the pool's layout (`plan_overrides`: slots per layer, eviction policy, prefetch and its
placement, side slots, autopin). Each of those the user gave, in a TOML file, the environment, `--set`
or a flag, or `Engine(..., **overrides)` (qnpipe.config.explicit_settings), either narrows the search
(`Fixed`: only that eviction policy; prefetch on, or off) or, where no plan can keep it, is a
ConfigError naming the setting and where it came from. `pool.capacity_profile_path` is refused by
qnpipe.plan.startup.precheck.
"""

from __future__ import annotations

import msgspec

from qnpipe.config import Config, EvictPolicy, PrefetchInto, explicit_settings
from qnpipe.errors import ConfigError

# A plan's candidates prefetch into the main region with no side slots (the same memory as demand-only:
# qnpipe.plan.search); the account holds no side region.
SIDE_SLOTS = 0


class Fixed(msgspec.Struct, frozen=True, kw_only=True):
    """What the user fixed of a plan (part of the plan cache's key: qnpipe.plan.startup.cache_key)."""

    policy: str | None = None  # the user's built-in eviction policy; None: the planner's choice
    prefetch: bool | None = None  # the user's cross-layer prefetch, or off where their placement has no room
    # The user's MLX buffer cache (GB), which the account then holds instead of what the plan derives: given
    # at its default value it still plans otherwise than not given, so the key must tell the two apart.
    cache_limit_gb: float | None = None


def user_fixed(cfg: Config) -> Fixed:
    """What `cfg`'s given settings fix of a plan; ConfigError naming a given setting no plan can keep."""
    given = explicit_settings(cfg)

    def refuse(path: str, why: str) -> ConfigError:
        return ConfigError(f"{path} ({given[path]}) with a memory plan (--memory, plan.memory): {why}")

    if "pool.expert_slots" in given:
        raise refuse("pool.expert_slots", "the plan chooses the slots per layer; give one of them")
    if "pool.autopin" in given and cfg.pool.autopin:
        raise refuse("pool.autopin", "a plan runs with autopin off (the replay that chooses it pins nothing); "
                                     "drop pool.autopin=true or the plan")
    policy = None
    if "pool.evict_policy" in given:
        policy = str(cfg.pool.evict_policy)
        if not isinstance(cfg.pool.evict_policy, EvictPolicy):
            raise refuse("pool.evict_policy", f"{policy!r} is a plug-in; the planner replays the built-in policies "
                                              f"({', '.join(EvictPolicy)}): give one of them, or no plan")
    prefetch = cfg.predict.cross_layer_prefetch if "predict.cross_layer_prefetch" in given else None
    # A plan's prefetch lands in the main region with no side slots: a placement given otherwise has no such plan.
    for path, off in (("pool.prefetch_into", cfg.pool.prefetch_into is PrefetchInto.SIDE),
                      ("pool.side_region_slots", cfg.pool.side_region_slots != SIDE_SLOTS)):
        if path in given and off:
            if prefetch:
                raise refuse(path, f"a plan that prefetches (predict.cross_layer_prefetch=true, "
                                   f"{given['predict.cross_layer_prefetch']}) puts prefetches into the main region "
                                   f"with {SIDE_SLOTS} side slots; drop {path}")
            prefetch = False
    cache = cfg.memory.mlx_cache_limit_gb if "memory.mlx_cache_limit_gb" in given else None
    return Fixed(policy=policy, prefetch=prefetch, cache_limit_gb=cache)


__all__ = ["SIDE_SLOTS", "Fixed", "user_fixed"]
