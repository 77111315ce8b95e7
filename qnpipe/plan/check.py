"""Whether a plan is one the planner could have made for this run: a cached plan is applied only then.

The plan cache lives in the model directory (`<expert dir>/plans/<key>/plan.json`), and whoever ships a
model directory can compute its key, so a cached plan is data to check, not a decision to apply. Its
schema (qnpipe.plan.plan_file) already refuses a plug-in policy and settings a plan does not set;
`plan_problems` checks the rest against the run: the model's shape and MoE layers, the budget and
context, capacities between top-k and the expert count that fit the budget after the fixed lines, the
side slots, policy, prefetch and placement the planner gives (within what the user fixed:
qnpipe.plan.fixed), autopin off, and prefetch budgets equal to the config's own (they are in the key).
"""

from __future__ import annotations

from qnpipe.config import Config, PrefetchInto
from qnpipe.plan.account import CACHE_LINE, ModelFacts, fixed_lines
from qnpipe.plan.family_account import FamilyFacts
from qnpipe.plan.fixed import SIDE_SLOTS, Fixed
from qnpipe.plan.make import prefetch_budgets
from qnpipe.plan.plan_file import Plan
from qnpipe.plan.ranks import Share, layer_weights, share_lines, share_shape
from qnpipe.plan.search import POLICIES
from qnpipe.plan.units import fmt_bytes
from qnpipe.trace import ModelShape

SHOWN = 4  # bad layers named in a message


def _brief(s: ModelShape) -> str:
    return (f"{s.num_layers} layers, MoE layers {list(s.moe_layers)}, {s.num_experts} experts, top-{s.top_k}, "
            f"hidden {s.hidden_size}")


def _capacity_problems(plan: Plan, facts: ModelFacts | FamilyFacts, cfg: Config, shape: ModelShape, budget: int,
                       share: Share | None) -> list[str]:
    caps, k, e = plan.capacities, shape.top_k, shape.num_experts
    if extra := sorted(set(caps) - set(shape.moe_layers)):
        return [f"capacities: layers {extra[:SHOWN]} are not MoE layers of the model ({list(shape.moe_layers)})"]
    if missing := sorted(set(shape.moe_layers) - set(caps)):
        return [f"capacities: MoE layers {missing[:SHOWN]} have none"]
    if bad := [ly for ly in sorted(caps) if not k <= caps[ly] <= e]:
        return [f"capacities: layer {ly} has {caps[ly]} slots, outside top-k..experts ({k}..{e})" for ly in bad[:SHOWN]]
    if share is None or not isinstance(facts, ModelFacts):  # a share is of a native model (make._make_plans)
        lines = fixed_lines(facts, cfg, context=plan.context)
    else:
        lines = share_lines(facts, cfg, layer_weights(facts, cfg), share, context=plan.context)
    mine = next(x.nbytes for x in lines if x.name == CACHE_LINE)
    theirs = [x.nbytes for x in plan.account.lines if x.name == CACHE_LINE]
    if theirs != [mine]:
        return [f"account: MLX buffer cache {theirs}; this run's is {mine} bytes (it becomes memory.mlx_cache_limit_gb)"]
    # Without plan.process_bytes the process line is measured in each process: not what the key covers.
    fixed = sum(x.nbytes for x in lines if cfg.plan.process_bytes or x.name != "process outside MLX")
    pool = sum(c * facts.record_nbytes[ly] for ly, c in caps.items())
    if pool > budget - fixed:
        return [f"capacities: {sum(caps.values())} slots ({fmt_bytes(pool)} of records) do not fit the budget "
                f"{fmt_bytes(budget)} after the model's fixed lines ({fmt_bytes(fixed)})"]
    return []


def plan_problems(plan: Plan, facts: ModelFacts | FamilyFacts, cfg: Config, *, budget: int, device_name: str, synthetic: bool,
                  fixed: Fixed, share: Share | None = None) -> list[str]:
    """What makes `plan` other than a plan the planner makes for `facts` in `budget` under `cfg` (`fixed`:
    what the user fixed; `synthetic`: planned on the synthetic log), each naming the field; [] when none."""
    out = []
    shape = facts.shape if share is None else share_shape(facts.shape, share)
    if plan.shape != shape:
        return [f"shape: {_brief(plan.shape)}; the model's is {_brief(shape)}"]
    if plan.share != share:
        out.append(f"share: {plan.share}; this run plans {share}")
    if plan.memory_bytes != budget:
        out.append(f"memory_bytes {plan.memory_bytes}: the budget is {budget}")
    if plan.context != cfg.plan.context_tokens:
        out.append(f"context {plan.context}: plan.context_tokens is {cfg.plan.context_tokens}")
    if plan.device_name != device_name:
        out.append(f"device_name {plan.device_name!r}: the plan's device is {device_name!r}")
    if plan.log_synthetic != synthetic:
        out.append(f"log_synthetic {plan.log_synthetic}: this run plans on {'a synthetic' if synthetic else 'a'} log")
    if not out:
        out += _capacity_problems(plan, facts, cfg, shape, budget, share)
    if plan.side_region_slots != SIDE_SLOTS:
        out.append(f"side_region_slots {plan.side_region_slots}: a plan has {SIDE_SLOTS} (its prefetch lands in the "
                   f"main region)")
    if fixed.policy is not None and plan.evict_policy != fixed.policy:
        out.append(f"evict_policy {plan.evict_policy.value!r}: pool.evict_policy={fixed.policy} was given")
    elif fixed.policy is None and plan.evict_policy not in POLICIES:
        out.append(f"evict_policy {plan.evict_policy.value!r}: the planner chooses one of {', '.join(POLICIES)}")
    if fixed.prefetch is not None and plan.prefetch != fixed.prefetch:
        out.append(f"prefetch {str(plan.prefetch).lower()}: predict.cross_layer_prefetch="
                   f"{str(fixed.prefetch).lower()} was given")
    elif plan.prefetch and synthetic:
        out.append("prefetch on a synthetic log: it has no gate candidates to predict prefetch from")
    into, predictor = (PrefetchInto.MAIN, "recorded") if plan.prefetch else (PrefetchInto.SIDE, "none")
    if plan.prefetch_into != into or plan.predictor != predictor:
        out.append(f"prefetch_into {plan.prefetch_into.value!r} and predictor {plan.predictor!r}: a plan with "
                   f"prefetch {'on' if plan.prefetch else 'off'} has {into.value!r} and {predictor!r}")
    if plan.autopin:
        out.append("autopin true: a plan runs with autopin off")
    want = prefetch_budgets(cfg) if plan.prefetch else {}
    for key, value in plan.budgets.items():
        if key not in want:
            out.append(f"budgets: {key} on a plan that does not prefetch")
        elif value != want[key]:
            out.append(f"budgets: {key}={value}; the config's is {want[key]} (a plan is replayed with the config's)")
    if missing := [key for key in want if key not in plan.budgets]:
        out.append(f"budgets: {', '.join(missing)} missing")
    return out


__all__ = ["plan_problems"]
