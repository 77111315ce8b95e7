"""The memory planner: the fastest configuration of a model that fits a memory budget (docs/plan.md).

    plan = make_plan("qn80b-4bit", "8GB", log="run.qtrace")
    cfg = config.load(overrides=plan_overrides(plan, "plan-dir"))

`units` reads sizes ("8GB"), `account` adds up what a run takes besides the pool, `allocate` spreads
slots over layers by the miss-ratio curves, `search` replays the candidates, `make` puts it together,
`plan_file` is the versioned plan file and its config overrides, `fixed` what the user's own settings
fix of a plan, `check` whether a cached plan is one the planner could have made, `child` plans at start-up in a
child process (`startup`), `plot` draws it;
`layer_split` and `ranks` split the layers over the ranks of a ring (by bytes; by the memory account). Loading it loads
no MLX (the model's tensors are read from the safetensors headers; the KV bytes per token are
qnpipe.model.kvquant's, imported when an account is made).
"""

from __future__ import annotations

from qnpipe.plan.account import Account, Line, ModelFacts, minimum_budget, model_facts, shape_facts
from qnpipe.plan.make import make_plan, make_plans, replay_plan, resolve_device
from qnpipe.plan.plan_file import Candidate, Plan, capacity_profile, load_plan, plan_overrides, save_plan
from qnpipe.plan.units import fmt_bytes, parse_memory

__all__ = ["Account", "Candidate", "Line", "ModelFacts", "Plan", "capacity_profile", "fmt_bytes", "load_plan",
           "make_plan", "make_plans", "minimum_budget", "model_facts", "parse_memory", "plan_overrides",
           "replay_plan", "resolve_device", "save_plan", "shape_facts"]
