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

`--live` adds the budget check on tools/bench_stream.py's bench model (16 MoE layers x 128 experts, top-8;
made once under --work), `measure_live`:

  1. the device: `qnpipe.io.measure.measure_profile` (what `qnpipe bench io` runs) in a directory next to
     the model (same disk), the store's record size among the sizes, saved as the profile file that
     `--device measured` reads (`read.device_profile_path`);
  2. cost-fit runs: `qnpipe generate MODEL --tokens 10 -n LIVE_TOKENS --temperature 1 --seed 100 --trace LOG`
     at uniform slots per layer (bench_stream's demand settings: direct I/O, 16 reads in flight, no
     chunking; and as a plan sets the pool: no side region, no autopin, LRU; and MLX's buffer cache
     capped where the plans cap it, `memory.mlx_cache_limit_gb` = the account's buffer-cache line, which
     needs no cost), each in a child process; the first log is the one the plans plan from (every run has
     its routes). The slots (`--live-fit-slots auto`): first what each budget affords uniformly (top-k
     plus its `--live-fracs` of the experts), then, once planned (step 4), the plans' own capacities,
     the largest and the smallest first: the fit sees the hit rates and the buffer cache the measured
     runs have, never extrapolated to them (a list of slots instead cycles that list);
  3. the cost: `qnpipe.replay.cost_fit.fit_cost(LOGS, device, per_miss=True)` (what `qnpipe trace fit-cost
     LOGS --device measured --per-miss` writes): one least squares over every fit run's gaps;
  4. for each of 3 budgets (the fixed lines at `--live-context`, as a fresh process measures them, plus
     `--live-fracs` of every expert's record), a child `qnpipe generate ... --memory BUDGET --log LOG --set
     plan.device=measured --set plan.cost_path=COST -n 1` plans and caches the plan;
  5. `--live-rounds` rounds, each: every budget's `-n LIVE_TOKENS --json --trace EVENTS` child (the cached
     plan; the same prompt and seed, so the same tokens and routes under the plan's slots and policy; an event
     log written and dropped, as the fit runs write theirs: the cost is fitted from gaps that hold the
     log's writing), in an order rotated by round, then one more cost-fit run (the next fit slots);
  6. the cost refitted from every fit run (before and between the measured ones: the machine's load
     drifts over minutes, so the cost is fitted side by side with the runs it predicts, never from them),
     and each budget planned again with it: the prediction compared is that plan's when it chose the slots
     and policy that ran (`same_choice`), else the replay of the plan that ran under the refitted cost
     (`replanned_tok_s`: the new plan's own figure).

  peak_over_budget_min  min over the budgets of the same ratio: how much of the budget the run uses at most
  peak_over_budget      max over the budgets of the measured child's peak RSS (its /proc/self/status VmHWM at
                        exit: the process's resident high-water mark; its plan is read from the cache the
                        planning child wrote) / budget: what the budget bounds, since it is what the machine
                        must hold. (Not ru_maxrss: a forked child's keeps the parent's peak from before exec.)
  mlx_peak_over_budget  the same with MLX's peak (`mx.get_peak_memory`, the run's `peak_memory_bytes`):
                        MLX's own arrays only (weights, pool, KV, activations), not the interpreter
  tok_s_rel_err         max over the budgets of |live tok/s - plan's predicted tok/s| / predicted; live: the
                        median over the rounds of a run's forwards per second, all of them (generated tokens /
                        (prefill_s + decode_s): the one-token prompt's forward is a step of the log, and the
                        replay counts it); tok_s_rel_err_decode: the same with `decode_tok_s` (the first
                        forward left out); tok_s_rel_err_first_cost: against the plans of step 4 (the cost of
                        the first fit runs alone)
  live_cost             the refitted cost's terms; live_fit_tok_s: each fit run's tok/s, in order, and
                        live_fit_predicted_tok_s: each one's replay (its own slots) under that cost;
                        live_fit_slots: each one's slots; live_fit_cache_limit_gb: their buffer cache
  live                  per budget: budget, slots, policy, peak RSS, MLX peak, live and predicted tok/s, the
                        account's non-zero lines; with --live-baseline K=V (the budgets then start from that
                        setting's smallest budget), baseline_live_tok_s, baseline_peak_rss and
                        baseline_hit_rate_live: the plan made with K=V, run at the same budget in each round

    python tools/bench_plan.py
    python tools/bench_plan.py --tokens 2000 --budgets 8GB,16GB --table
    python tools/bench_plan.py --live
    python tools/bench_plan.py --live --live-set memory.mlx_cache_limit_gb=0.0625   # a buffer-cache line given
    python tools/bench_plan.py --live --live-baseline memory.mlx_cache_limit_gb=1.0  # beside the old 1 GiB reserve
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    p.add_argument("--live", action="store_true", help="also the live budget check on the bench model (measure_live)")
    p.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"),
                   help="where bench_stream.py caches its bench model")
    p.add_argument("--live-tokens", type=int, default=64, help="tokens of each live run (default 64)")
    p.add_argument("--live-fracs", default="0.125,0.25,0.5",
                   help="the 3 budgets: the fixed lines plus these fractions of every expert's record")
    p.add_argument("--live-rounds", type=int, default=5,
                   help="measured runs per budget: the median tok/s, the largest peaks (default 5)")
    p.add_argument("--live-context", type=int, default=256, help="plan.context_tokens of the live runs")
    p.add_argument("--live-fit-slots", default="auto",
                   help="pool.expert_slots of the cost-fit runs, cycled: one each before planning, one per round "
                        "(auto: what each budget affords uniformly, then the plans' own capacities)")
    p.add_argument("--profile", type=Path, default=None, help="a `qnpipe bench io` profile instead of measuring")
    p.add_argument("--live-baseline", action="append", default=[], metavar="KEY=VALUE",
                   help="also run, at each budget, the plan with this setting beside (budgets from its minimum), "
                        "e.g. memory.mlx_cache_limit_gb=1.0: the buffer-cache reserve before the plan chose it")
    p.add_argument("--live-set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config field of the live runs and their plans, e.g. memory.mlx_cache_limit_gb=0.0625")
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


LIVE_SET = {"read.workers": 16, "read.nocache": True, "forward.prefill_chunk_tokens": 0}  # bench_stream's demand run
LIVE_PROMPT = "10"  # bench_stream.round_prompt(0): one token
# The fit runs' pool as a plan sets it (plan_overrides: no side region, no autopin, prefetch off), so
# they differ from the measured runs only in the slots and the eviction policy.
FIT_SET = {"pool.autopin": False, "pool.side_region_slots": 0}


# The child runs the CLI, then writes its own VmHWM (the resident high-water mark of this process image:
# exec starts it afresh, where a forked child's ru_maxrss keeps the parent's pre-exec peak) to the file named first.
_CHILD = (
    "import sys\n"
    "from qnpipe.cli import main\n"
    "rc = main(sys.argv[2:])\n"
    "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
    "open(sys.argv[1], 'w').write(str(int(hwm.split()[1]) * 1024))\n"
    "sys.exit(rc)\n")


def _child(argv: list[str], sets: dict[str, object]) -> tuple[str, str, int]:
    """`qnpipe ARGV --set K=V...` in a child process: (stdout, stderr, its peak RSS in bytes: VmHWM)."""
    import subprocess
    import sys

    text_of = {True: "true", False: "false"}
    with tempfile.TemporaryDirectory() as d:
        hwm = Path(d) / "hwm"
        cmd = [sys.executable, "-c", _CHILD, str(hwm), *argv,
               *(a for k, v in sets.items()
                 for a in ("--set", f"{k}={text_of.get(v, v) if isinstance(v, bool) else v}"))]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[3:])}: exit {proc.returncode}\n{proc.stderr}")
        return proc.stdout, proc.stderr, int(hwm.read_text())


def _least(model: Path, sets: dict[str, object], context: int) -> tuple[int, float]:
    """The bench model's smallest budget as a fresh process sees it (its own "process outside MLX" line:
    this process has planned the 80B, and its resident set is not a generate child's), and the
    `memory.mlx_cache_limit_gb` its plans set (the account's buffer-cache line: cost-free, so known
    before any fit run)."""
    import subprocess
    import sys

    code = ("import sys, json\nfrom qnpipe import config\nfrom qnpipe.plan import minimum_budget, model_facts\n"
            "from qnpipe.plan.account import CACHE_LINE, GB, fixed_lines\n"
            "sets = json.loads(sys.argv[1])\ncfg = config.load(None, overrides=sets)\n"
            "facts, context = model_facts(sets['model.model_dir'], cfg), int(sys.argv[2])\n"
            "cache = next(x.nbytes for x in fixed_lines(facts, cfg, context=context) if x.name == CACHE_LINE)\n"
            "print(minimum_budget(facts, cfg, context=context), cache / GB)\n")
    text_of = {True: "true", False: "false"}
    over = {k: (text_of[v] if isinstance(v, bool) else str(v)) for k, v in {**sets, "model.model_dir": model}.items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(over), str(context)], capture_output=True, text=True,
                          env=env, check=True)
    least, cache_gb = proc.stdout.split()[-2:]
    return int(least), float(cache_gb)


def measure_live(args: argparse.Namespace, plans: list[Plan]) -> dict[str, Any]:
    """The budget check on the bench model (module doc): peak_over_budget, tok_s_rel_err."""
    import importlib.util

    import msgspec

    from qnpipe.io.device_file import load_profile, save_profile
    from qnpipe.io.measure import measure_profile
    from qnpipe.io.store import ExpertStore
    from qnpipe.plan import load_plan, model_facts, replay_plan
    from qnpipe.replay.cost_fit import fit_cost, save_cost

    del plans  # the 80B plans are not run: the bench model is
    spec = importlib.util.spec_from_file_location("bench_stream", ROOT / "tools" / "bench_stream.py")
    assert spec is not None and spec.loader is not None
    bench_stream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_stream)
    model = bench_stream.make_model(args.work, "bench", 4, 64)
    with ExpertStore.open(model) as store:
        lf = store.layer_file(next(iter(store.layers)))
        record = lf.record_nbytes
    tmp = Path(tempfile.mkdtemp(prefix="qnpipe-bench-plan-"))
    device_file = tmp / "device.json"
    if args.profile:
        save_profile(device_file, load_profile(args.profile))
    else:
        measured = measure_profile(Path(model).resolve().parent, records=sorted({13824, 98304, record, 1769472}),
                                   qds=(1, 2, 4, 8, 16), seconds=0.4, size_bytes=2**30)
        save_profile(device_file, measured)
    device = load_profile(device_file).profile
    base = {**LIVE_SET, "read.device_profile_path": device_file, **dict(kv.split("=", 1) for kv in args.live_set)}
    gen = ["generate", str(model), "--tokens", LIVE_PROMPT, "--temperature", "1", "--seed", "100"]
    baseline = dict(kv.split("=", 1) for kv in args.live_baseline)
    least, plan_cache_gb = _least(model, {**base, **baseline}, args.live_context)
    if baseline:  # the budgets start at the baseline's minimum; the plans measured keep their own cache line
        plan_cache_gb = _least(model, base, args.live_context)[1]
    facts = model_facts(model, config.load(None, overrides={**base, "model.model_dir": str(model)}))
    n_experts, top_k = facts.args.num_experts, facts.shape.top_k
    all_records = sum(facts.record_nbytes.values()) * n_experts
    fracs = [float(f) for f in args.live_fracs.split(",")]
    budgets = [least + int(f * all_records) for f in fracs]
    # The fit runs run as the plans will: their buffer cache (the plan's line), and slots spanning theirs:
    # first what each budget affords uniformly (top-k + its fraction of the experts), then, once planned,
    # each plan's largest and smallest capacity (module doc).
    fit_set = {**base, **FIT_SET, "memory.mlx_cache_limit_gb": plan_cache_gb}
    auto = args.live_fit_slots == "auto"
    fit_slots = ([min(n_experts, top_k + round(f * n_experts)) for f in fracs] if auto
                 else [int(x) for x in args.live_fit_slots.split(",")])
    fit_logs: list[Path] = []
    fit_tok_s: list[float] = []
    fit_ran: list[int] = []  # each fit run's slots per layer, in order
    cycle = [0]  # the next of fit_slots

    def fit_run() -> None:
        """One cost-fit run: a traced run at the next of the fit slots (uniform slots, LRU)."""
        log = tmp / f"fit-{len(fit_logs)}.qtrace"
        slots = fit_slots[cycle[0] % len(fit_slots)]
        cycle[0] += 1
        out, _, _ = _child([*gen, "-n", str(args.live_tokens), "--trace", str(log), "--json"],
                           {**fit_set, "pool.expert_slots": slots})
        fit_logs.append(log)
        fit_ran.append(slots)
        fit_tok_s.append(_steps_tok_s(json.loads(out)))

    def cost(name: str) -> Path:
        path = tmp / name
        save_cost(path, fit_cost(fit_logs, device, per_miss=True))
        return path

    for _ in list(fit_slots):
        fit_run()
    log = fit_logs[0]  # the routes every run has (same prompt and seed; capacities never change them)
    first_cost = cost("cost-first.json")
    plan_set = {**base, "plan.device": "measured", "plan.cache_dir": tmp / "plans",
                "plan.context_tokens": args.live_context}

    def plan_of(budget: int, cost_file: Path) -> Plan:
        """Plan (a child: `generate --memory ... -n 1`, cached) and read the plan it made."""
        _, err, _ = _child([*gen, "--memory", str(budget), "--log", str(log), "-n", "1"],
                           {**plan_set, "plan.cost_path": cost_file})
        where = err.split("cached at ")[-1].split("]")[0] if "cached at " in err else err.split("reused from ")[-1]
        return load_plan(where.split("]")[0].strip())

    planned = {b: plan_of(b, first_cost) for b in budgets}
    if auto:  # the rounds' fit runs: the plans' own capacities, the largest and the smallest first
        caps = sorted({c for p in planned.values() for c in p.capacities.values()})
        fit_slots[:] = [caps[-1], caps[0], *caps[1:-1]] if len(caps) > 1 else caps
        cycle[0] = 0
    runs: dict[int, list[tuple[dict[str, Any], int]]] = {b: [] for b in budgets}
    base_runs: dict[int, list[tuple[dict[str, Any], int]]] = {b: [] for b in budgets}
    # Rounds: every budget once (in a rotated order), then one more cost-fit run, so the cost is
    # fitted from runs taken side by side with the measured ones (the machine's load drifts).
    for r in range(args.live_rounds):
        for b in budgets[r % len(budgets):] + budgets[:r % len(budgets)]:
            # Traced as the fit runs are (the event log's writing is in the gaps the cost is fitted
            # from), so the measured runs differ from them only in the plan's slots and policy.
            events = tmp / "measured.qtrace"
            out, err, rss = _child([*gen, "--memory", str(b), "--log", str(log), "-n", str(args.live_tokens),
                                    "--json", "--trace", str(events)], {**plan_set, "plan.cost_path": first_cost})
            events.unlink(missing_ok=True)
            assert "plan reused from" in err, err
            runs[b].append((json.loads(out), rss))
            if baseline:  # the baseline's plan at the same budget, beside (planned and cached on its first run)
                out, err, rss = _child([*gen, "--memory", str(b), "--log", str(log), "-n", str(args.live_tokens),
                                        "--json"], {**plan_set, **baseline, "plan.cost_path": first_cost})
                base_runs[b].append((json.loads(out), rss))
        fit_run()
    final_cost = cost("cost.json")
    # The fit runs' own replays under the final cost: how well the model holds where it was fitted
    # (run to run, the machine's drift is what is left).
    from qnpipe.replay.cost_fit import load_cost
    from qnpipe.replay.runner import replay

    fitted = load_cost(final_cost).cost
    fit_pred = [replay(f, config.load(None, overrides={**fit_set, "pool.expert_slots": slots}),
                       device_profile=device, cost=fitted).tok_s for f, slots in zip(fit_logs, fit_ran, strict=True)]
    rows = []
    for b in budgets:
        plan, first = plan_of(b, final_cost), planned[b]
        same = (plan.capacities, plan.evict_policy, plan.prefetch) == (first.capacities, first.evict_policy,
                                                                        first.prefetch)
        # What ran, under the refitted cost: the new plan's own figure when it chose the same (a
        # plan's prediction is its replay's, bit for bit), else the replay of the plan that ran.
        predicted = plan.predicted_tok_s if same else replay_plan(
            msgspec.structs.replace(first, cost=fitted), tmp / f"ran-{b}",
            config.load(None, overrides=dict(base))).tok_s
        tok_s = [_steps_tok_s(r) for r, _ in runs[b]]
        decode = [r["stats"]["decode_tok_s"] for r, _ in runs[b]]
        caps = sorted(first.capacities.values())
        rows.append({"budget": b, "slots": f"{caps[0]}-{caps[-1]}", "policy": first.evict_policy,
                     "peak_rss": max(rss for _, rss in runs[b]),
                     "mlx_peak": max(r["stats"]["peak_memory_bytes"] for r, _ in runs[b]),
                     "live_tok_s": round(statistics.median(tok_s), 3), "live_tok_s_rounds": [round(t, 3) for t in tok_s],
                     "live_decode_tok_s": round(statistics.median(decode), 3),
                     "predicted_tok_s": round(predicted, 3), "same_choice": same,
                     "replanned_tok_s": round(plan.predicted_tok_s, 3),
                     "predicted_tok_s_first_cost": round(first.predicted_tok_s, 3),
                     "hit_rate_live": round(runs[b][0][0]["engine"]["pool"]["hit_rate"], 4),
                     "hit_rate_predicted": round(plan.predicted_hit_rate, 4),
                     "account": {x.name: x.nbytes for x in first.account.lines if x.nbytes}})
        if base_runs[b]:
            rows[-1] |= {"baseline_live_tok_s": round(statistics.median(_steps_tok_s(r) for r, _ in base_runs[b]), 3),
                         "baseline_peak_rss": max(rss for _, rss in base_runs[b]),
                         "baseline_hit_rate_live": round(base_runs[b][0][0]["engine"]["pool"]["hit_rate"], 4)}
    fit = json.loads((tmp / "cost.json").read_text())
    shutil.rmtree(tmp, ignore_errors=True)

    def rel(r: dict[str, Any], live: str, pred: str) -> float:
        return abs(r[live] - r[pred]) / r[pred]

    return {"peak_over_budget": round(max(r["peak_rss"] / r["budget"] for r in rows), 4),
            "peak_over_budget_min": round(min(r["peak_rss"] / r["budget"] for r in rows), 4),
            "mlx_peak_over_budget": round(max(r["mlx_peak"] / r["budget"] for r in rows), 4),
            "tok_s_rel_err": round(max(rel(r, "live_tok_s", "predicted_tok_s") for r in rows), 4),
            "tok_s_rel_err_first_cost": round(max(rel(r, "live_tok_s", "predicted_tok_s_first_cost") for r in rows), 4),
            "tok_s_rel_err_decode": round(max(rel(r, "live_decode_tok_s", "predicted_tok_s") for r in rows), 4),
            "live_cost": {k: fit["cost"][k] for k in ("per_layer_s", "per_step_s", "per_miss_s", "read_hop_s")},
            "live_fit_tok_s": [round(t, 3) for t in fit_tok_s], "live_fit_slots": fit_ran,
            "live_fit_cache_limit_gb": plan_cache_gb,
            "live_fit_predicted_tok_s": [round(t, 3) for t in fit_pred],
            "live_set": args.live_set, "live_baseline": args.live_baseline, "live_loadavg": [round(x, 2) for x in os.getloadavg()],
            "live_model": str(model), "live_record_nbytes": record, "live_min_budget": least, "live": rows}


def _steps_tok_s(run: dict[str, Any]) -> float:
    """A run's forwards per second, every one (the first: the one-token prompt's) as the replay counts them."""
    s = run["stats"]
    return s["generated_tokens"] / (s["prefill_s"] + s["decode_s"])


MEASURES: list[Callable[..., dict[str, Any]]] = []  # more measures(args, plans) -> dict, merged into the JSON line


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
        for m in [*MEASURES, *([measure_live] if args.live else [])]:
            out |= m(args, plans)
        if args.table:
            out["table"] = table(Path(tmp), log, args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
