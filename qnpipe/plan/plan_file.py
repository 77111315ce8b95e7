"""The plan file: a versioned JSON file (qnpipe.io.versioned), and the config overrides that apply it.

A plan file is data: its schema holds only what the planner writes (a built-in eviction policy, never
a plug-in; only the prefetch budgets' keys; counts that are counts), so `load_plan` refuses anything
else naming the file. Whether a plan fits a run (its model, budget and config) is qnpipe.plan.check's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec

from qnpipe.config import EvictPolicy, PrefetchInto
from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_write
from qnpipe.io.simssd import DeviceProfile
from qnpipe.io.versioned import load_versioned, save_versioned
from qnpipe.plan.account import Account, cache_limit_gb
from qnpipe.plan.ranks import Share
from qnpipe.replay.runner import CostModel
from qnpipe.trace import ModelShape

PLAN_KIND = "qnpipe-plan"
PLAN_VERSION = 1

# The settings a prefetching plan records as it was replayed (qnpipe.plan.make.prefetch_budgets).
BudgetKey = Literal["read.bg_budget_experts", "predict.per_layer_budget_experts",
                    "predict.file_global_budget_experts", "predict.stage_global_budget_experts"]
BUDGET_KEYS: tuple[BudgetKey, ...] = get_args(BudgetKey)
Count = Annotated[int, msgspec.Meta(ge=0)]


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration the search replayed, and what the replay measured."""

    name: str  # e.g. "planned lru", "uniform lfu", "planned lru + prefetch (main)"
    allocation: str  # "planned" or "uniform"
    evict_policy: EvictPolicy
    prefetch: bool
    total_slots: int  # resident + side, over all layers: equal memory across a budget's candidates
    tok_s: float
    hit_rate: float
    bytes_per_token: float
    curve_hit_rate: float  # LRU's miss-ratio curve over the whole log at this allocation
    belady_hit_rate: float  # Belady's curve over the whole log at this allocation (what no policy beats)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What `qnpipe plan` chose for a model in a memory budget, and the replay that predicts it.

    `predicted_*` are the exact fast replay's (`qnpipe.plan.replay_plan`) of the log's steps
    `replay_first_step..log_steps - 1` (the timing window; earlier steps are skipped, not replayed).
    For one rank of a pipeline (`share`), `log` is the log restricted to that rank's layers."""

    kind: str = PLAN_KIND
    version: int = PLAN_VERSION
    model: str
    shape: ModelShape
    memory_bytes: int
    context: int
    log: str
    log_synthetic: bool
    log_steps: int
    replay_first_step: int
    replay_train_frac: float  # PredictorOpts.train_frac that skips exactly replay_first_step steps
    device_name: str
    device: DeviceProfile
    cost: CostModel
    record_nbytes: int
    capacities: dict[Count, Count]
    side_region_slots: Count
    evict_policy: EvictPolicy
    prefetch: bool
    prefetch_into: PrefetchInto
    predictor: Literal["none", "recorded"]  # the replay's predictor: "recorded" is the log's own gate candidates
    autopin: bool
    budgets: dict[BudgetKey, Count]  # the prefetch budgets the replay ran with (config keys)
    predicted_tok_s: float
    predicted_hit_rate: float
    predicted_bytes_per_token: float
    account: Account
    candidates: list[Candidate]
    notes: list[str] = []
    plan_s: float = 0.0
    # Pipeline parallel: the rank and layer range planned (its MoE layers are `shape.moe_layers`, its
    # account that rank's, its predictions its layers' alone: docs/distributed.md); None for a whole model.
    share: Share | None = None


def save_plan(path: str | os.PathLike[str], plan: Plan, *, nofollow: bool = False) -> None:
    """Write `plan` to `path` atomically (OSError names the path; `nofollow`: qnpipe.io.atomic)."""
    save_versioned(path, plan, nofollow=nofollow)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """The plan at `path`; ConfigError naming the file when absent, corrupt or not a plan."""
    return load_versioned(path, Plan, kind=PLAN_KIND, version=PLAN_VERSION, error=ConfigError, what="plan file",
                          remedy="a plan file is written by `qnpipe plan MODEL_DIR --memory 8GB -o FILE`")


def capacity_profile(plan: Plan) -> bytes:
    """The plan's capacities in `pool.capacity_profile_path`'s format (qnpipe.policy.build.layer_capacities)."""
    return json.dumps({"layer_caps": {str(k): v for k, v in sorted(plan.capacities.items())}}, indent=1).encode()


def plan_settings(plan: Plan, profile: str | os.PathLike[str]) -> dict[str, object]:
    """The config overrides that run `plan`, its capacity profile (`capacity_profile`) written at `profile`;
    MLX's buffer cache capped at the account's line (a figure the user gave, or the planned one)."""
    return {"pool.capacity_profile_path": os.fspath(profile), "pool.side_region_slots": plan.side_region_slots,
            "memory.mlx_cache_limit_gb": cache_limit_gb(plan.account),
            "pool.evict_policy": plan.evict_policy, "predict.cross_layer_prefetch": plan.prefetch,
            "pool.prefetch_into": plan.prefetch_into, "pool.autopin": plan.autopin, **plan.budgets}


def plan_overrides(plan: Plan, out_dir: str | os.PathLike[str]) -> dict[str, object]:
    """The config overrides that run `plan` (`config.load(overrides=...)`, `with_overrides`): writes the
    capacity profile `capacities.json` into `out_dir` (atomically) and points `pool.capacity_profile_path` at it."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    profile = d / "capacities.json"
    atomic_write(profile, capacity_profile(plan))
    return plan_settings(plan, profile)


__all__ = ["BUDGET_KEYS", "PLAN_KIND", "PLAN_VERSION", "BudgetKey", "Candidate", "Plan", "capacity_profile",
           "load_plan", "plan_overrides", "plan_settings", "save_plan"]
