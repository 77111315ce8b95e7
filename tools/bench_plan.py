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
  2. a live log: `qnpipe generate MODEL --tokens 10 -n LIVE_TOKENS --temperature 1 --seed 100 --trace LOG`
     (pool.expert_slots 32, bench_stream's demand settings: direct I/O, 16 reads in flight, no autopin,
     no chunking), in a child process;
  3. the cost: `qnpipe.replay.cost_fit.fit_cost(LOG, device)` (what `qnpipe trace fit-cost LOG --device
     measured` writes), saved as the cost file;
  4. for each of 3 budgets (the fixed lines at `--live-context` plus `--live-fracs` of every expert's
     record), a child `qnpipe generate ... --memory BUDGET --log LOG --set plan.device=measured --set
     plan.cost_path=COST` with `-n 1` plans and caches the plan, then the same with `-n LIVE_TOKENS --json`
     reuses it and is measured: the same prompt and seed as the logged run, so the same tokens and routes
     (capacity invariance) under the plan's slots and policy.

  peak_over_budget      max over the budgets of the measured child's peak RSS (its /proc/self/status VmHWM at
                        exit: the process's resident high-water mark; its plan is read from the cache the
                        planning child wrote) / budget: what the budget bounds, since it is what the machine
                        must hold. (Not ru_maxrss: a forked child's keeps the parent's peak from before exec.)
  mlx_peak_over_budget  the same with MLX's peak (`mx.get_peak_memory`, the run's `peak_memory_bytes`):
                        MLX's own arrays only (weights, pool, KV, activations), not the interpreter
  tok_s_rel_err         max over the budgets of |live tok/s - plan's predicted tok/s| / predicted; live: the median
                        `decode_tok_s` of `--live-rounds` runs
  live                  per budget: budget, slots, policy, peak RSS, MLX peak, live and predicted tok/s

    python tools/bench_plan.py
    python tools/bench_plan.py --tokens 2000 --budgets 8GB,16GB --table
    python tools/bench_plan.py --live
    python tools/bench_plan.py --live --live-set memory.mlx_cache_limit_gb=0.0625   # a tight buffer-cache line
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
    p.add_argument("--live-rounds", type=int, default=3,
                   help="measured runs per budget: the median tok/s, the largest peaks (default 3)")
    p.add_argument("--live-context", type=int, default=256, help="plan.context_tokens of the live runs")
    p.add_argument("--profile", type=Path, default=None, help="a `qnpipe bench io` profile instead of measuring")
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


def measure_live(args: argparse.Namespace, plans: list[Plan]) -> dict[str, Any]:
    """The budget check on the bench model (module doc): peak_over_budget, tok_s_rel_err."""
    import importlib.util

    from qnpipe.io.device_file import load_profile, save_profile
    from qnpipe.io.measure import measure_profile
    from qnpipe.io.store import ExpertStore
    from qnpipe.plan import load_plan, minimum_budget, model_facts
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
    base = {**LIVE_SET, "read.device_profile_path": device_file, **dict(kv.split("=", 1) for kv in args.live_set)}
    gen = ["generate", str(model), "--tokens", LIVE_PROMPT, "--temperature", "1", "--seed", "100"]
    log = tmp / "live.qtrace"
    _child([*gen, "-n", str(args.live_tokens), "--trace", str(log)], {**base, "pool.expert_slots": 32,
                                                                      "pool.autopin": False})
    cost_file = tmp / "cost.json"
    save_cost(cost_file, fit_cost(log, load_profile(device_file).profile))
    cfg = config.load(None, overrides={**base, "model.model_dir": str(model)})
    facts = model_facts(model, cfg)
    least = minimum_budget(facts, cfg, context=args.live_context)
    all_records = sum(facts.record_nbytes.values()) * facts.args.num_experts
    plan_set = {**base, "plan.device": "measured", "plan.cost_path": cost_file, "plan.cache_dir": tmp / "plans",
                "plan.context_tokens": args.live_context}
    rows = []
    for frac in (float(f) for f in args.live_fracs.split(",")):
        budget = least + int(frac * all_records)
        mem = ["--memory", str(budget), "--log", str(log)]
        _child([*gen, *mem, "-n", "1"], plan_set)  # plans and caches
        runs = []
        for _ in range(args.live_rounds):
            out, err, rss = _child([*gen, *mem, "-n", str(args.live_tokens), "--json"], plan_set)
            assert "plan reused from" in err, err
            runs.append((json.loads(out), rss))
        plan = next(p for f in (tmp / "plans").glob("*/plan.json") if (p := load_plan(f)).memory_bytes == budget)
        tok_s = [r["stats"]["decode_tok_s"] for r, _ in runs]
        live = statistics.median(tok_s)
        caps = sorted(plan.capacities.values())
        rows.append({"budget": budget, "slots": f"{caps[0]}-{caps[-1]}", "policy": plan.evict_policy,
                     "peak_rss": max(rss for _, rss in runs),
                     "mlx_peak": max(r["stats"]["peak_memory_bytes"] for r, _ in runs),
                     "live_tok_s": round(live, 3), "live_tok_s_rounds": [round(t, 3) for t in tok_s],
                     "predicted_tok_s": round(plan.predicted_tok_s, 3),
                     "hit_rate_live": round(runs[0][0]["engine"]["pool"]["hit_rate"], 4),
                     "hit_rate_predicted": round(plan.predicted_hit_rate, 4)})
    shutil.rmtree(tmp, ignore_errors=True)
    return {"peak_over_budget": round(max(r["peak_rss"] / r["budget"] for r in rows), 4),
            "mlx_peak_over_budget": round(max(r["mlx_peak"] / r["budget"] for r in rows), 4),
            "tok_s_rel_err": round(max(abs(r["live_tok_s"] - r["predicted_tok_s"]) / r["predicted_tok_s"]
                                       for r in rows), 4),
            "live_set": args.live_set, "live_loadavg": [round(x, 2) for x in os.getloadavg()], "live_model": str(model), "live_record_nbytes": record, "live_min_budget": least, "live": rows}


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
