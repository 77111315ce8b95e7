"""Miss-ratio curve speed: `qnpipe replay LOG --mrc`'s computation on a synthetic log (issue 25).

Writes a synthetic routing log (`qnpipe trace synth`: default 48 MoE layers x 512 experts, top-10,
10,000 one-token steps, Zipf popularity, some locality and cross-layer correlation), or takes `--log`,
and computes its LRU and Belady curves at every capacity (qnpipe.replay.mrc) in this process, one
core. Prints one JSON line:

  mrc_s            wall seconds of `miss_ratio_curves(LOG)`: reading the log and both curves (what
                   `--mrc` spends before writing its CSV and plot); target < 10 s at the default shape
  mrc_cpu_s        ... in this process's CPU seconds (the figure to compare on a loaded machine)
  load_s, lru_s, belady_s  wall seconds of `load_log`, and of each curve alone on the loaded log
                   (measured after mrc_s, apart from it)
  native           whether the C loops (qnpipe.replay._mrc_opt, built at install) ran; else the numpy ones
  layer_steps, requests  layer-steps and expert requests of the log (each counted once per curve)
  capacities       capacities per curve (top-k .. experts)
  hit_rate_lru, hit_rate_belady  the totals at a few capacities (a sanity check, and what the CSV holds)
  synth_s          wall seconds to write the log (not part of mrc_s)
  digest           sha256 of the curves' rows (the same for the same log, before and after a speed-up)

    python tools/bench_mrc.py
    python tools/bench_mrc.py --tokens 2000 --policies lru
    python tools/bench_mrc.py --numpy            # the numpy loops, as without a C compiler at install
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import msgspec

from qnpipe.replay import load_log
from qnpipe.replay.mrc import POLICIES, miss_ratio_curves, mrc, native_available
from qnpipe.replay.mrc_export import summary_capacities
from qnpipe.replay.synth import SynthSpec, write_synth


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", type=Path, default=None, help="a routing or event log to use instead of a synthetic one")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--locality", type=float, default=0.3)
    p.add_argument("--cross-layer", type=float, default=0.5)
    p.add_argument("--popularity", default="zipf:1.0")
    p.add_argument("--policies", default="lru,belady", help="comma-separated, of lru and belady (default both)")
    p.add_argument("--numpy", action="store_true", help="the numpy loops even when the C ones (qnpipe.replay._mrc_opt) are built")
    return p.parse_args(argv)


def run(args: argparse.Namespace, log: Path) -> dict[str, object]:
    policies = [p for p in args.policies.split(",") if p]
    assert all(p in POLICIES for p in policies), policies
    native = False if args.numpy else None
    w0, c0 = time.perf_counter(), time.process_time()
    result = miss_ratio_curves(log, policies=policies, native=native)  # what `qnpipe replay LOG --mrc` computes
    mrc_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
    t0 = time.perf_counter()
    routes = load_log(log)
    load_s = time.perf_counter() - t0
    parts: dict[str, float] = {}
    for policy in policies:  # each curve alone, on the loaded log (its share of mrc_s, with the routes' layout)
        t0 = time.perf_counter()
        mrc(routes.steps, routes.shape, policies=[policy], log=str(log), native=native)
        parts[policy] = time.perf_counter() - t0
    rows = msgspec.json.encode([{**r, "layer": str(r["layer"])} for r in result.rows()])
    caps = summary_capacities(result)
    rates = {p: {str(c): round(result.curve(p).hit_rate()[c - result.min_capacity], 4) for c in caps}
             for p in policies}
    return {"mrc_s": round(mrc_s, 3), "mrc_cpu_s": round(cpu_s, 3), "load_s": round(load_s, 3),
            "lru_s": round(parts["lru"], 3) if "lru" in parts else None,
            "belady_s": round(parts["belady"], 3) if "belady" in parts else None,
            "native": native_available() and not args.numpy,
            "layer_steps": sum(len(s) for s in routes.steps),
            "requests": result.curves[-1].requests[-1] if result.curves else 0,
            "capacities": routes.shape.num_experts - routes.shape.top_k + 1,
            **{f"hit_rate_{p}": rates[p] for p in policies},
            "digest": hashlib.sha256(rows).hexdigest()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log
        if log is None:
            spec = SynthSpec(layers=args.layers, experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                             seed=args.seed, locality=args.locality, cross_layer=args.cross_layer,
                             popularity=args.popularity)
            t0 = time.perf_counter()
            log = write_synth(Path(tmp) / "synth.qtrace", spec)
            out["synth_s"] = round(time.perf_counter() - t0, 3)
            out["shape"] = f"{args.layers}x{args.experts} top-{args.top_k}, {args.tokens} steps"
        out |= run(args, log)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
