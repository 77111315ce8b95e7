"""Planner speed and quality: `qnpipe plan` at 5 budgets on a 48-layer x 512-expert top-10 log (issue 26).

Writes a synthetic routing log (default 48 MoE layers x 512 experts, top-10, 10,000 one-token steps,
Zipf popularity, some locality and cross-layer correlation: tools/bench_mrc.py's), or takes `--log`,
and plans the Qwen3-Next-80B shape (tests/plan/data/qwen3-next-80b-a3b.config.json at 4 bits: 1,769,472
bytes per expert) at `--budgets` in one `make_plans` call, in this process, one core. Prints one JSON line:

  plan_s         wall seconds of make_plans (facts, budget check, curves, every candidate's replay, the plans)
  plan_cpu_s     ... in this process's CPU seconds (the figure to compare on a loaded machine)
  budgets        the budgets (bytes)
  replays        candidates replayed in all; window_steps: the steps each timing replay covers
  plans          per budget: the chosen policy, predicted tok/s and hit rate, and uniform allocation's
  synth_s        wall seconds to write the log (not part of plan_s)

`--table` adds `table`: at 4 budgets on 3 imported real traces (tests/data/traces) and on this log, the
planned and the uniform allocation's replayed hit rate and tok/s at the same slots (LRU, demand only,
the whole log; Belady's curve at the planned slots beside).

The live keys of issue 26 (`peak_over_budget`, `tok_s_rel_err`: a real run at each plan on the bench
model) are measured by a `measure_live(args, plans)` added to MEASURES; they are not measured here.

    python tools/bench_plan.py
    python tools/bench_plan.py --tokens 2000 --budgets 8GB,16GB --table
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qnpipe import config
from qnpipe.plan import Plan, make_plans, parse_memory, shape_facts
from qnpipe.replay.synth import SynthSpec, write_synth

ROOT = Path(__file__).resolve().parent.parent
CONFIG_80B = ROOT / "tests" / "plan" / "data" / "qwen3-next-80b-a3b.config.json"
TRACES = ROOT / "tests" / "data" / "traces"
REAL = [("mixtral-humaneval", "mixtral-jsonl", TRACES / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl.gz", 0),
        ("mixtral-raw", "mixtral-jsonl", TRACES / "Mario928__speculative-moe" / "routing_raw.jsonl.gz", 0),
        ("qwen-totani", "vllm-jsonl", TRACES / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz", 0)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", type=Path, default=None, help="a routing log of the 80B shape instead of a synthetic one")
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budgets", default="6GB,8GB,12GB,16GB,24GB")
    p.add_argument("--device", default="apple-m5-internal")
    p.add_argument("--window-layer-steps", type=int, default=12_000)
    p.add_argument("--table", action="store_true", help="also the planned-vs-uniform table (real traces and this log)")
    return p.parse_args(argv)


def measure_plan(args: argparse.Namespace, log: Path) -> tuple[dict[str, Any], list[Plan]]:
    budgets = [parse_memory(b) for b in args.budgets.split(",")]
    facts = shape_facts(CONFIG_80B, bits=4)
    w0, c0 = time.perf_counter(), time.process_time()
    plans = make_plans(facts, budgets, log=log, device=args.device, cfg=config.load(None),
                       window_layer_steps=args.window_layer_steps)
    out = {"plan_s": round(time.perf_counter() - w0, 2), "plan_cpu_s": round(time.process_time() - c0, 2),
           "budgets": budgets, "replays": sum(len({c.name for c in p.candidates if c.name.startswith("planned")})
                                               + (not _same_as_planned(p)) for p in plans),
           "window_steps": plans[0].log_steps - plans[0].replay_first_step,
           "plans": [{"budget": p.memory_bytes, "policy": p.evict_policy, "prefetch": p.prefetch,
                      "tok_s": round(p.predicted_tok_s, 4), "hit_rate": round(p.predicted_hit_rate, 4),
                      "uniform_tok_s": round(_uniform(p).tok_s, 4), "uniform_hit_rate": round(_uniform(p).hit_rate, 4)}
                     for p in plans]}
    return out, plans


def _uniform(p: Plan) -> Any:
    return next(c for c in p.candidates if c.allocation == "uniform")


def _same_as_planned(p: Plan) -> bool:
    u = _uniform(p)
    return any(c.allocation == "planned" and c.evict_policy == u.evict_policy and c.tok_s == u.tok_s
               and c.hit_rate == u.hit_rate for c in p.candidates)


def table(tmp: Path, log: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Planned vs uniform at 4 budgets (slots per layer on average), whole-log LRU replays."""
    from qnpipe.io.sim_model import PROFILES
    from qnpipe.plan.search import Search
    from qnpipe.replay.runner import CostModel
    from qnpipe.trace.importers import import_log

    rows = []
    logs = []
    for name, fmt, src, _ in REAL:
        out = tmp / f"{name}.qtrace"
        import_log(fmt, src, out, max_steps=None)
        logs.append((name, out, 1 << 20, 0))
    logs.append(("bench-synth", log, 1769472, args.window_layer_steps))
    for name, path, nbytes, window in logs:
        s = Search(path, config.load(None), device=PROFILES[args.device], cost=CostModel(), record_nbytes=nbytes,
                   window_layer_steps=window or 10**12, work_dir=tmp)
        k, e, n = s.k, s.e, len(s.log.shape.moe_layers)
        small = e - k <= 8  # a few experts (Mixtral's 8): one slot apart, else spread over the range
        for per in [min(e, k + i) for i in (1, 2, 3, 4)] if small else [k + (e - k) * f // 8 for f in (1, 2, 3, 5)]:
            total = per * n
            got = {}
            for alloc, caps in (("planned", s.planned(total)), ("uniform", s.uniform(total))):
                c = s.run(alloc, alloc, caps, "lru", False).candidate
                got[alloc] = c
            rows.append({"log": name, "steps": len(s.log.steps) - s.first, "slots_per_layer": per,
                         "planned_hit": round(got["planned"].hit_rate, 4), "uniform_hit": round(got["uniform"].hit_rate, 4),
                         "planned_tok_s": round(got["planned"].tok_s, 3), "uniform_tok_s": round(got["uniform"].tok_s, 3),
                         "belady_at_planned": round(got["planned"].belady_hit_rate, 4)})
    return rows


MEASURES: list[Callable[..., dict[str, Any]]] = []  # e.g. measure_live(args, plans) -> peak_over_budget, tok_s_rel_err


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log
        if log is None:
            spec = SynthSpec(layers=48, experts=512, top_k=10, tokens=args.tokens, seed=args.seed, locality=0.3,
                             cross_layer=0.5, popularity="zipf:1.0")
            t0 = time.perf_counter()
            log = write_synth(Path(tmp) / "synth.qtrace", spec)
            out["synth_s"] = round(time.perf_counter() - t0, 3)
        measured, plans = measure_plan(args, log)
        out |= measured
        for m in MEASURES:
            out |= m(args, plans)
        if args.table:
            out["table"] = table(Path(tmp), log, args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
