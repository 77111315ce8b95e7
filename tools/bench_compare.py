"""Two checkouts side by side: replay's drivers and the pipeline alone, alternating runs, one JSON line.

On a shared machine CPU figures drift by a fifth from minute to minute, so two benchmarks
run at different times say little. This runs each checkout's own code (a subprocess with
the checkout as its working directory and PYTHONPATH, its own tools/bench_replay.py and
tools/bench_stream.py) in alternating rounds (A B, then B A, ...) and compares the best
figure of each (the run least disturbed by other load). Measured, in CPU time:

  fast      layer-steps per CPU second of replay's heap driver (a synthetic log, as bench_replay)
  actors    ... of replay's actor driver
  allhit    CPU microseconds per layer-step of the pipeline alone, every expert resident
            (bench_stream's `bench_pipeline`, no model, reads done at once)
  demand    ... with a quarter of each layer's experts (demand misses)

Prints {"base": {...}, "new": {...}, "speed_ratio": {...}, "digests_equal": ...}: `speed_ratio`
is new's speed over base's (>1: new is faster; for the pipeline, base's microseconds over new's).
`digests_equal`: both checkouts' heap-driver reports are byte-identical.

    python tools/bench_compare.py /path/to/base /path/to/new --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# Runs inside a checkout: prints one JSON line of that checkout's figures.
_CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "tools")
import bench_replay as br
import bench_stream as bs
from qnpipe import config
from qnpipe.replay.synth import SynthSpec, write_synth

a = json.loads(sys.argv[1])
out = {}
cfg = config.load(None, overrides={"pool.expert_slots": "64", "pool.side_region_slots": "8"})
opts = br.PredictorOpts()
with tempfile.TemporaryDirectory() as tmp:
    def log_of(tokens):
        log = Path(tmp) / f"synth{tokens}.qtrace"
        if not log.exists():
            write_synth(log, SynthSpec(layers=48, experts=512, top_k=10, tokens=tokens, seed=1, locality=0.3,
                                       cross_layer=0.5, popularity="zipf:1.0"))
        return log
    if a["fast_tokens"]:
        log = log_of(a["fast_tokens"])
        best = None
        for _ in range(a["repeat"]):
            c0 = time.process_time()
            rep = br.replay(log, cfg, record_nbytes=br.RECORD_80B_4BIT, predictor="previous", opts=opts)
            cpu = time.process_time() - c0
            best = cpu if best is None else min(best, cpu)
        out["fast"] = rep.steps * 48 / best
        out["digest"] = br._digest(rep, log)
    if a["actor_tokens"]:
        log = log_of(a["actor_tokens"])
        c0 = time.process_time()
        rep = br.replay(log, cfg, record_nbytes=br.RECORD_80B_4BIT, predictor="previous", opts=opts, driver="actors")
        out["actors"] = rep.steps * 48 / (time.process_time() - c0)
    for name, cap in (("allhit", 128), ("demand", 32)):
        if a["pipeline"]:
            out[name] = min(bs.bench_pipeline(16, 128, 8, cap, 310000, 16, hop=False)["cpu_us"]
                            for _ in range(a["repeat"]))
print(json.dumps(out))
"""

_HIGHER_IS_FASTER = {"fast": True, "actors": True, "allhit": False, "demand": False}


def run_child(checkout: Path, args: argparse.Namespace) -> dict[str, float | str]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    spec = json.dumps({"fast_tokens": args.fast_tokens, "actor_tokens": args.actor_tokens,
                       "pipeline": not args.no_pipeline, "repeat": args.repeat})
    res = subprocess.run([sys.executable, "-c", _CHILD, spec], cwd=checkout, env=env, capture_output=True,
                         text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"bench_compare: {checkout} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--repeat", type=int, default=2, help="runs per round and checkout, the best kept (default 2)")
    p.add_argument("--fast-tokens", type=int, default=300, help="tokens of the heap driver's log (0: skip)")
    p.add_argument("--actor-tokens", type=int, default=100, help="tokens of the actor driver's log (0: skip)")
    p.add_argument("--no-pipeline", action="store_true", help="skip the pipeline-alone figures")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float | str]]] = {"base": [], "new": []}
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for name in order:
            runs[name].append(run_child(getattr(args, name), args))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{n} {json.dumps({k: v for k, v in runs[n][-1].items() if k != 'digest'})}" for n in ("base", "new")),
            file=sys.stderr, flush=True)
    best: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        best[name] = {}
        for key, faster in _HIGHER_IS_FASTER.items():
            vals = [float(x[key]) for x in rs if key in x]
            if vals:
                best[name][key] = round(max(vals) if faster else min(vals), 2)
    ratio = {key: round(best["new"][key] / best["base"][key] if faster else best["base"][key] / best["new"][key], 4)
             for key, faster in _HIGHER_IS_FASTER.items() if key in best["new"] and key in best["base"]}
    digests = {str(x["digest"]) for rs in runs.values() for x in rs if "digest" in x}
    print(json.dumps({"base": best["base"], "new": best["new"], "speed_ratio": ratio,
                      "digests_equal": len(digests) <= 1, "rounds": args.rounds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
