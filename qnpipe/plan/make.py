"""`make_plan`: the fastest configuration of a model that fits a memory budget, from a routing log.

    plan = make_plan("qn80b-4bit", "8GB", log="run.qtrace", device="measured")
    cfg = config.load(overrides=plan_overrides(plan, "plan-dir"))

Bad input is refused before any replay: an unknown or unreadable device profile, a bad cost file, a
budget below the smallest that fits (named), a log of another model's shape, a setting given that no
plan can keep (qnpipe.plan.fixed).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from qnpipe import config as config_mod
from qnpipe.config import Config, with_overrides
from qnpipe.config.user_dirs import device_profile_path
from qnpipe.errors import ConfigError
from qnpipe.io.device_file import device_names, load_profile, named_profile
from qnpipe.io.simssd import DeviceProfile
from qnpipe.plan.account import (
    Account,
    ModelFacts,
    account,
    fixed_lines,
    minimum_budget,
    pool_lines,
    shape_facts,
)
from qnpipe.plan.family_account import FamilyFacts, dir_facts
from qnpipe.plan.fixed import user_fixed
from qnpipe.plan.measured import measured_device
from qnpipe.plan.plan_file import BUDGET_KEYS, BudgetKey, Plan, plan_overrides
from qnpipe.plan.published import load_published, published_cost, published_names
from qnpipe.plan.ranks import Share, check_ranks, layer_weights, restricted_log, share_lines, share_shape
from qnpipe.plan.search import WINDOW_LAYER_STEPS, Search, slot_totals
from qnpipe.plan.units import fmt_bytes, parse_memory
from qnpipe.replay.runner import CostModel, PredictorOpts, ReplayReport, replay
from qnpipe.replay.synth import SynthSpec, write_synth
from qnpipe.trace import ModelShape

# The stand-in for a recorded log: bench_replay's and bench_mrc's mix of popularity, locality and correlation.
SYNTH = {"tokens": 1000, "seed": 1, "locality": 0.3, "cross_layer": 0.5, "popularity": "zipf:1.0"}


def prefetch_budgets(cfg: Config) -> dict[BudgetKey, int]:
    """The prefetch budgets a prefetching plan was replayed with, as config overrides: `cfg`'s own."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in BUDGET_KEYS}


def resolve_device(device: str | Path | DeviceProfile, cfg: Config) -> tuple[str, DeviceProfile]:
    """(name, profile) of a built-in name, `measured`, or a profile file (`qnpipe bench io`'s)."""
    if isinstance(device, DeviceProfile):
        return "given", device.check(where="device.")
    name = str(device)
    if name == "measured":  # this machine's: measured once into the user cache when none is saved there
        path = device_profile_path(cfg)
        return name, (measured_device(path) if not cfg.read.device_profile_path else named_profile(name, str(path)))
    if name in device_names():
        return name, named_profile(name, cfg.read.device_profile_path)
    if name in published_names():  # shipped data whose every figure names its public source
        return name, load_published(name).device
    if Path(name).exists():
        return name, load_profile(name).profile
    raise ConfigError(f"--device {name}: neither a device profile ({', '.join(device_names() + published_names())}) "
                      f"nor a profile file")


def resolve_cost(cost: CostModel | str | Path | None) -> CostModel:
    if cost is None:
        return CostModel()
    if isinstance(cost, CostModel):
        return cost.check()
    from qnpipe.replay.cost_fit import load_cost

    return load_cost(cost).cost


def resolve_model(model: str | Path | ModelFacts | FamilyFacts, cfg: Config,
                  bits: int | None = None) -> ModelFacts | FamilyFacts:
    """Facts as given, a `qnpipe convert` directory's (of any family), or a bare `config.json`'s (`bits` for its records)."""
    if isinstance(model, ModelFacts | FamilyFacts):
        return model
    p = Path(model)
    if p.is_file():
        return shape_facts(p, bits=bits)
    return dir_facts(p, cfg)


def check_budgets(facts: ModelFacts | FamilyFacts, cfg: Config, budgets: Sequence[int], *, context: int, headroom_bytes: int) -> int:
    """The smallest budget that fits; ConfigError naming it when a budget is below."""
    least = minimum_budget(facts, cfg, context=context, headroom_bytes=headroom_bytes)
    if low := [b for b in budgets if b < least]:
        fixed = fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes)
        parts = ", ".join(f"{x.name} {fmt_bytes(x.nbytes)}" for x in fixed if x.nbytes)
        raise ConfigError(f"--memory {fmt_bytes(min(low))}: below the smallest budget that fits this model, "
                          f"{fmt_bytes(least)} ({least} bytes: {parts}, and top-k "
                          f"({facts.shape.top_k}) expert slots per MoE layer)")
    return least


def synth_spec(shape: ModelShape) -> SynthSpec:
    """The synthetic log's spec for a model of `shape` (one synthetic layer per MoE layer)."""
    return SynthSpec(layers=len(shape.moe_layers), experts=shape.num_experts, top_k=shape.top_k, **SYNTH)


def synthetic_log(facts: ModelFacts | FamilyFacts, path: str | Path) -> Path:
    """A synthetic routing log of the model's shape (SYNTH), written once at `path`."""
    a = facts.shape
    p = Path(path)
    if p.is_symlink() or not p.exists():
        # Under a name of its own, renamed over a link (never through it) and over another planner's copy
        # (the same bytes): two planners at once never share a partial file, one killed leaves no torn log.
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}.tmp")
        try:
            write_synth(tmp, synth_spec(a), moe_layers=a.moe_layers, num_layers=a.num_layers)
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)
    return p


def make_plans(model: str | Path | ModelFacts | FamilyFacts, budgets: Sequence[int | str], *, log: str | Path | None = None,
               device: str | Path | DeviceProfile = "measured", cost: CostModel | str | Path | None = None,
               context: int = 8192, cfg: Config | None = None, headroom_bytes: int = 0, bits: int | None = None,
               window_layer_steps: int = WINDOW_LAYER_STEPS, synth_path: str | Path | None = None,
               say: Callable[[str], None] | None = None, share: Share | None = None) -> list[Plan]:
    """One plan per budget (bytes, or text like "8GB": qnpipe.plan.units.parse_memory), sharing the log's
    curves; see the module doc. `say` gets one line per step and per replayed candidate.

    `share`: plan one rank of a pipeline-parallel run (qnpipe.plan.ranks): its MoE layers only, on the log
    restricted to them (`restricted_log`, written beside `synth_path`), in its own account (its layers'
    weights and state); the budget is that rank's.

    What `cfg` was given of the settings a plan sets is kept (qnpipe.plan.fixed: ConfigError naming one no
    plan can keep). The run's temporary files (the candidates' capacity profiles; without `synth_path`,
    the synthetic and restricted logs) are in a private temporary directory, removed when it returns or fails."""
    with tempfile.TemporaryDirectory(prefix="qnpipe-plan-") as scratch:
        return _make_plans(model, budgets, log=log, device=device, cost=cost, context=context, cfg=cfg,
                           headroom_bytes=headroom_bytes, bits=bits, window_layer_steps=window_layer_steps,
                           synth_path=synth_path, say=say, share=share, scratch=Path(scratch))


def _make_plans(model: str | Path | ModelFacts | FamilyFacts, budgets: Sequence[int | str], *, log: str | Path | None,
                device: str | Path | DeviceProfile, cost: CostModel | str | Path | None, context: int,
                cfg: Config | None, headroom_bytes: int, bits: int | None, window_layer_steps: int,
                synth_path: str | Path | None, say: Callable[[str], None] | None, share: Share | None,
                scratch: Path) -> list[Plan]:
    t0 = time.perf_counter()
    cfg = cfg if cfg is not None else config_mod.load()
    say = say or (lambda s: None)
    if context < 1:
        raise ConfigError(f"--context {context}: must be at least 1 token")
    if headroom_bytes < 0:
        raise ConfigError(f"--headroom {headroom_bytes}: must be >= 0 bytes")
    fixed = user_fixed(cfg)
    sizes = [parse_memory(b) if isinstance(b, str) else int(b) for b in budgets]
    facts = resolve_model(model, cfg, bits)
    dev_name, dev = resolve_device(device, cfg)
    cost_model = resolve_cost(cost if cost is not None else published_cost(device))  # a published device's own
    shape = facts.shape
    if share is None:
        check_budgets(facts, cfg, sizes, context=context, headroom_bytes=headroom_bytes)
        lines = fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes)
    elif not isinstance(facts, ModelFacts):
        raise ConfigError(f"a plan per rank: pipeline parallel runs on qwen3_next's native path only, "
                          f"not on a {facts.model_type} model")
    else:
        weights = layer_weights(facts, cfg)
        check_ranks(facts, cfg, weights, [share], [min(sizes)], context=context, headroom_bytes=headroom_bytes)
        lines = share_lines(facts, cfg, weights, share, context=context, headroom_bytes=headroom_bytes)
        shape = share_shape(shape, share)
        if not shape.moe_layers:
            raise ConfigError(f"{share.label}: no MoE layer: nothing to plan")
    notes = []
    if log is None:
        log = synthetic_log(facts, synth_path if synth_path is not None else scratch / "synth.qtrace")
        kept = f" ({log})" if synth_path is not None else " (written for this run only)"
        notes.append(f"no --log: planned on a synthetic log of the model's shape{kept}; record a real one with "
                     f"`qnpipe generate MODEL_DIR --trace run.qtrace` and plan with --log run.qtrace")
        say(notes[-1])
    if share is not None:
        log = restricted_log(log, share, Path(synth_path).parent if synth_path is not None else scratch)
    rec = max(facts.record_nbytes[ly] for ly in shape.moe_layers)
    fixed_bytes = sum(x.nbytes for x in lines)
    search = Search(log, cfg, device=dev, cost=cost_model, record_nbytes=rec, window_layer_steps=window_layer_steps,
                    work_dir=scratch, say=say, expect=shape, fixed=fixed)
    say(f"curves of {len(search.log.steps)} steps; timing replays of steps {search.first}..{len(search.log.steps) - 1}")
    plans = []
    for budget, total in zip(sizes, slot_totals(sizes, fixed_bytes, rec), strict=True):
        say(f"{fmt_bytes(budget)}: {min(total, search.max_slots)} resident slots")
        best, tried = search.choose(total)
        if share is None:
            acct = account(facts, cfg, best.capacities, side_slots=best.side_slots, context=context, budget=budget,
                           headroom_bytes=headroom_bytes)
        else:
            acct = Account(budget=budget, lines=lines + pool_lines(facts, best.capacities, best.side_slots))
        r = best.report
        plans.append(Plan(
            model=facts.source, shape=shape, share=share, memory_bytes=budget, context=context, log=str(log),
            log_synthetic=bool(notes), log_steps=len(search.log.steps), replay_first_step=search.first,
            replay_train_frac=search.frac, device_name=dev_name, device=dev, cost=cost_model, record_nbytes=rec,
            capacities=best.capacities, side_region_slots=best.side_slots,
            evict_policy=best.candidate.evict_policy, prefetch=best.candidate.prefetch,
            prefetch_into=best.prefetch_into, predictor=best.predictor, autopin=False,
            budgets=prefetch_budgets(cfg) if best.candidate.prefetch else {},
            predicted_tok_s=r.tok_s, predicted_hit_rate=r.hit_rate, predicted_bytes_per_token=r.bytes_per_token,
            account=acct, candidates=[c.candidate for c in tried], notes=notes))
    dt = time.perf_counter() - t0
    return [msgspec.structs.replace(p, plan_s=dt) for p in plans]


def make_plan(model: str | Path | ModelFacts | FamilyFacts, memory: int | str, **kw: object) -> Plan:
    """`make_plans` at one budget."""
    return make_plans(model, [memory], **kw)[0]  # type: ignore[arg-type]


def replay_plan(plan: Plan, work_dir: str | Path, cfg: Config | None = None) -> ReplayReport:
    """The replay whose figures the plan predicts: its log's timing window under `plan_overrides`. A
    synthetic log written for the planning run only is written again into `work_dir` (the same bytes)."""
    cfg = cfg if cfg is not None else config_mod.load()
    cfg = with_overrides(cfg, plan_overrides(plan, work_dir))
    log = Path(plan.log)
    if plan.log_synthetic and not log.exists():
        log = write_synth(Path(work_dir) / "synth.qtrace", synth_spec(plan.shape))
        if plan.share is not None:
            log = restricted_log(log, plan.share, work_dir)
    return replay(log, cfg, device_profile=plan.device, cost=plan.cost, record_nbytes=plan.record_nbytes,
                  predictor=plan.predictor, opts=PredictorOpts(train_frac=plan.replay_train_frac))


__all__ = ["SYNTH", "check_budgets", "make_plan", "make_plans", "prefetch_budgets", "replay_plan", "resolve_cost",
           "resolve_device", "resolve_model", "synth_spec", "synthetic_log"]
