"""Planning at start-up: `--memory 8GB` on generate, chat and serve, `Engine(model_dir, memory="8GB")`.

    cfg, plan = plan_at_startup(cfg, say=print)   # before the model loads; cfg unchanged without plan.memory

The log planned from, in this order: `plan.log` (`--log`); the log an earlier run of the same model
directory recorded at `Config.recorded_log_path()` (`<expert dir>/trace.qtrace`, what `--trace` with no
file writes, beside autopin's `<expert dir>/pool_usage.json`); else a synthetic log of the model's shape.

The plan is cached in `plan.cache_dir` (default `<expert dir>/plans`; `<key>/plan.json`, with the capacity
profile it applies beside it), keyed by the sha256 of what it depends on: the model (its facts and its store
index), the log (its bytes; a synthetic log's spec), the budget, context, device profile, cost model, the
settings the account and the replay read, and what the user fixed of a plan (qnpipe.plan.fixed).

The cache is in the model directory, whose shipper can compute the key: a cached plan is data. One that
cannot be read, or is not a plan the planner could have made for this run (qnpipe.plan.check), is said
("ignoring the cached plan FILE: ...") and planned again. Nothing in the cache is read or written through
a symlink (the default `plans` directory, `<key>`, `plan.json`, `capacities.json`); a cache that cannot be
written is said, and the capacity profile goes into a private temporary directory removed at exit. The
plan never overrides a setting the user gave (qnpipe.config.explicit_settings): it is planned with it.

Distributed, each rank plans its own layers (`plan_for_share`) once the ring has split them by the memory
account (qnpipe.plan.ranks, qnpipe.live.parallel.join), keyed by its rank and layer range too.
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from qnpipe.config import Config, explicit_settings, with_overrides
from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_write
from qnpipe.plan.account import ModelFacts
from qnpipe.plan.check import plan_problems
from qnpipe.plan.child import plan_in_child
from qnpipe.plan.family_account import FamilyFacts, dir_facts
from qnpipe.plan.fixed import Fixed, user_fixed
from qnpipe.plan.make import SYNTH, check_budgets, resolve_cost, resolve_device
from qnpipe.plan.plan_file import PLAN_VERSION, Plan, capacity_profile, load_plan, plan_settings, save_plan
from qnpipe.plan.ranks import Share
from qnpipe.plan.units import fmt_bytes, parse_memory
from qnpipe.replay.cost import CostModel

# Sections that neither the account nor the replay reads (or that the plan sets itself: plan, and the
# model's paths, which the model's own fingerprint covers).
_NOT_KEYED = ("model", "plan", "trace", "chat", "prefix", "diag", "compute", "distributed", "net")


def find_log(cfg: Config, share: Share | None = None) -> Path | None:
    """The log to plan from: `plan.log`, else the model's recorded log when present, else (for one rank of a
    pipeline, `share`) the log this rank recorded there in a distributed run, else None (synthetic)."""
    if cfg.plan.log:
        p = Path(cfg.plan.log)
        if not p.is_file():
            raise ConfigError(f"plan.log={cfg.plan.log} (--log): no such file; record one with "
                              f"`qnpipe generate MODEL_DIR -p TEXT --trace FILE`")
        return p
    recorded = Path(cfg.recorded_log_path())
    if recorded.is_file():
        return recorded
    if share is not None:  # named as qnpipe.live.parallel.join.rank_config names a rank's routing log
        mine = recorded.with_name(f"{recorded.stem}.rank{share.rank}{recorded.suffix}")
        return mine if mine.is_file() else None
    return None


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(facts: ModelFacts | FamilyFacts, cfg: Config) -> str:
    h = hashlib.sha256(msgspec.json.encode(facts))
    index = Path(cfg.model.resolved_expert_dir()) / "index.json"
    if index.is_file():
        h.update(index.read_bytes())
    return h.hexdigest()


def cache_key(facts: ModelFacts | FamilyFacts, cfg: Config, log: Path | None, *, budget: int, share: Share | None = None) -> str:
    """The sha256 of everything the plan depends on (module doc); a rank's plan also its rank and layers."""
    _, dev = resolve_device(cfg.plan.device, cfg)
    cost = resolve_cost(cfg.plan.cost_path or None)
    settings = {k: v for k, v in msgspec.to_builtins(cfg).items() if k not in _NOT_KEYED}
    parts = {"version": PLAN_VERSION, "model": model_fingerprint(facts, cfg),
             "log": _file_digest(log) if log is not None else {"synthetic": SYNTH},
             "budget": budget, "context": cfg.plan.context_tokens, "device": msgspec.to_builtins(dev),
             "cost": msgspec.to_builtins(cost), "settings": settings,
             # The account's process line when set (measured, it is this machine's, like the device).
             "process_bytes": cfg.plan.process_bytes}
    if share is not None:
        parts["share"] = msgspec.to_builtins(share)
    if (fixed := user_fixed(cfg)) != Fixed():  # the same setting given or defaulted plans otherwise
        parts["fixed"] = msgspec.to_builtins(fixed)
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()


def describe_line(plan: Plan, where: str) -> str:
    """The one line that says what was chosen."""
    caps = sorted(plan.capacities.values())
    prefetch = f"prefetch on ({plan.prefetch_into})" if plan.prefetch else "prefetch off"
    cost = "the default" if plan.cost == CostModel() else "a fitted"  # plan.cost_path, qnpipe trace fit-cost
    who, mine = (f"{plan.share.label} of {plan.share.ranks}: ", " for its layers") if plan.share else ("", "")
    return (f"{who}memory {fmt_bytes(plan.memory_bytes)}: {caps[0]}-{caps[-1]} slots per layer "
            f"({plan.evict_policy.upper()}), {prefetch}, predicted {plan.predicted_tok_s:.1f} tok/s{mine} on "
            f"{plan.device_name} with {cost} cost, hit rate {plan.predicted_hit_rate:.2f} [{where}]")


def precheck(cfg: Config) -> int:
    """`plan.memory` in bytes, after the checks that need neither the model's facts nor a layer split:
    ConfigError for a conflicting capacity profile or another setting given that no plan can keep
    (qnpipe.plan.fixed), a model without an expert store, a `--log` not found."""
    budget = parse_memory(cfg.plan.memory, key="--memory")
    if cfg.pool.capacity_profile_path:
        raise ConfigError(f"--memory {cfg.plan.memory} with pool.capacity_profile_path="
                          f"{cfg.pool.capacity_profile_path}: both choose the slots per layer; give one")
    user_fixed(cfg)
    model_dir = Path(cfg.model.model_dir)
    if not (Path(cfg.model.resolved_expert_dir()) / "index.json").is_file():
        raise ConfigError(f"--memory {cfg.plan.memory}: {model_dir} has no expert store "
                          f"({cfg.model.resolved_expert_dir()}/index.json): the planner sizes a streamed pool; "
                          f"convert the model first (`qnpipe convert {model_dir} --out DIR`)")
    find_log(cfg)
    return budget


def plan_at_startup(cfg: Config, *, say: Callable[[str], None] | None = None,
                    distributed: bool | None = None) -> tuple[Config, Plan | None]:
    """`cfg` with the plan for `plan.memory` applied (and `plan.memory` cleared, so it is applied once),
    and the plan; `cfg` and None when `plan.memory` is empty. Runs before the model loads: a budget that
    cannot fit is a ConfigError naming the smallest that does.

    Distributed (`distributed`, default `distributed.enabled`): only `precheck`, and `cfg` as it is: each
    rank plans its own layers once the ring has split them (`plan_for_share`, qnpipe.live.parallel.join)."""
    if not cfg.plan.memory:
        return cfg, None
    budget = precheck(cfg)
    if cfg.distributed.enabled if distributed is None else distributed:
        return cfg, None
    facts = dir_facts(Path(cfg.model.model_dir), cfg)
    check_budgets(facts, cfg, [budget], context=cfg.plan.context_tokens, headroom_bytes=0)
    return _plan(cfg, facts, budget, None, say or (lambda s: None))


def plan_for_share(cfg: Config, facts: ModelFacts | FamilyFacts, share: Share, *,
                   say: Callable[[str], None] | None = None) -> tuple[Config, Plan | None]:
    """As `plan_at_startup`, for rank `share.rank` of a pipeline holding layers `share.lo..hi-1`: its MoE
    layers planned in its own account with its own budget, on the log restricted to its layers
    (qnpipe.plan.ranks). `facts` are the model's (`dir_facts`). A rank without MoE layers has no plan."""
    if not cfg.plan.memory:
        return cfg, None
    say = say or (lambda s: None)
    budget = precheck(cfg)
    if not any(share.holds(ly) for ly in facts.shape.moe_layers):
        say(f"{share.label} of {share.ranks}: no MoE layer, no pool to plan")
        return with_overrides(cfg, {"plan.memory": ""}), None
    return _plan(cfg, facts, budget, share, say)


def _plan(cfg: Config, facts: ModelFacts | FamilyFacts, budget: int, share: Share | None,
          say: Callable[[str], None]) -> tuple[Config, Plan]:
    model_dir = Path(cfg.model.model_dir)
    log = find_log(cfg, share)
    key = cache_key(facts, cfg, log, budget=budget, share=share)
    root = Path(cfg.plan.cache_dir or Path(cfg.model.resolved_expert_dir()) / "plans")
    cache = root / key[:16]
    cached = cache / "plan.json"
    # The user's own cache directory (plan.cache_dir) may be a link; the model directory's is not followed.
    links = ([] if cfg.plan.cache_dir else [root]) + [cache, cached]
    plan = _cached_plan(cached, links, facts, cfg, budget, share, log is None, say)
    unusable = _cache_dir(root, cache, links[:-1])
    if plan is None:
        s = facts.shape
        # A rank's own directory: ranks on one machine share the cache and must not write one file at once.
        synth = None if unusable else (root if share is None else cache) / \
            f"synth-{s.num_layers}x{s.num_experts}x{s.top_k}.qtrace"  # else make_plan's private temp dir
        # In a child process (qnpipe.plan.child): the log, its curves and the candidates' replays are held
        # there and freed with it, not in this process, whose peak is what the budget bounds.
        plan, peak = plan_in_child(cfg, budget, log=log, synth_path=synth, share=share)
        where = f"planned in {plan.plan_s:.1f} s, "
        if peak is not None and peak > budget:
            say(f"planning itself (a child process, before the model loads) peaked at {fmt_bytes(peak)} resident, "
                f"above the budget {fmt_bytes(budget)}: plan once beforehand (the same command; the plan is "
                f"cached) so a run does not plan")
        try:
            if unusable:
                raise OSError(unusable)
            save_plan(cached, plan, nofollow=True)
            where += f"cached at {cached}"
        except OSError as e:
            unusable = unusable or str(e)
            where += f"not cached: {e}"
    else:
        where = f"plan reused from {cached}"
    if plan.log_synthetic:
        say(f"no routing log of this model ({cfg.recorded_log_path()}): planned on a synthetic log of its shape; "
            f"record a real one with --trace (qnpipe generate {model_dir} -p TEXT --trace) or give --log")
    profile = cache / "capacities.json"
    try:
        if unusable:
            raise OSError(unusable)
        atomic_write(profile, capacity_profile(plan), nofollow=True)
    except OSError:
        profile = _private_profile(plan)
        where += f"; its capacity profile in {profile}, removed at exit"
    say(describe_line(plan, where))
    given = explicit_settings(cfg)  # equal to the plan's (qnpipe.plan.check), or of no effect with its prefetch
    overrides = {k: v for k, v in plan_settings(plan, profile).items() if k not in given}
    return with_overrides(cfg, {**overrides, "plan.memory": ""}), plan


def _linked(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.is_symlink()), None)


def _cached_plan(cached: Path, links: list[Path], facts: ModelFacts | FamilyFacts, cfg: Config, budget: int, share: Share | None,
                 synthetic: bool, say: Callable[[str], None]) -> Plan | None:
    """The plan cached at `cached` when it is one the planner could have made for this run, else None
    (said, naming the file and what is wrong with it)."""
    if (link := _linked(links)) is not None:
        say(f"ignoring the cached plan {cached}: {link} is a symlink (not followed)")
        return None
    if not cached.exists():
        return None
    try:
        plan = load_plan(cached)
    except ConfigError as e:  # names the file first
        say(f"ignoring the cached plan {e}; planning again")
        return None
    problems = plan_problems(plan, facts, cfg, budget=budget, device_name=resolve_device(cfg.plan.device, cfg)[0],
                             synthetic=synthetic, fixed=user_fixed(cfg), share=share)
    if problems:
        say(f"ignoring the cached plan {cached}: {'; '.join(problems)}; planning again")
        return None
    return plan


def _cache_dir(root: Path, cache: Path, links: list[Path]) -> str:
    """Make the key's directory `cache` under `root`: '' when it is a directory of its own, else why not."""
    if (link := _linked(links)) is not None:
        return f"{link} is a symlink: not written through"
    try:
        root.mkdir(parents=True, exist_ok=True)
        cache.mkdir(exist_ok=True)
    except OSError as e:
        return str(e)
    if (link := _linked(links)) is not None:  # planted meanwhile
        return f"{link} is a symlink: not written through"
    return ""


def _private_profile(plan: Plan) -> Path:
    """The plan's capacity profile in a fresh private temporary directory, removed at exit: the pool reads it
    when the engine is built, after this returns."""
    d = Path(tempfile.mkdtemp(prefix="qnpipe-plan-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    profile = d / "capacities.json"
    atomic_write(profile, capacity_profile(plan), nofollow=True)
    return profile


__all__ = ["cache_key", "describe_line", "find_log", "model_fingerprint", "plan_at_startup", "plan_for_share",
           "precheck"]
