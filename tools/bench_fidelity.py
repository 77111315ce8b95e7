"""Replay fidelity on the bench model: a live demand-only run against its replay (issue 11).

For each round: a live `tools/bench_stream.py`-style demand run (the pool at `--pool-frac` of
each layer's experts, direct I/O, `read.workers` reads in flight, no prefetch, no autopin, a
1-token prompt, temperature 1) writes its event log; `qnpipe.replay.cost_fit.fit_cost` fits the cost
model from that log against the device profile; `qnpipe.replay` replays the log with that
profile and cost. Compared per round, then the median over the rounds:

* `misses_rel_err`: the largest |replay - live| / live over the miss causes (live: the
  engine's `pool.misses_by_cause`; replay: the report's `misses_by_cause`). Target <= 0.02.
* `tok_s_rel_err`: |replay tok_s - live tok_s| / live tok_s, live = `GenerateStats.decode_tok_s`
  (tokens after the first / time after the first, as bench_stream's `tok_s_demand`), replay =
  the report's `tok_s` (steps per virtual second). Target <= 0.15.
  `tok_s_rel_err_without_read_hop`: the same with the cost's `read_hop_s` set to 0 (the
  measured device alone for the miss path: how much the fitted hop term carries).
  `tok_s_rel_err_cross`: out of sample, each round's log replayed with the cost fitted from
  the round before (the in-sample figure is close by construction: the least-squares
  intercept makes the fitted gaps sum to the live ones, and `read_hop_s` is a mean).

The device profile is `--profile FILE` (a `qnpipe bench io` file) or, by default, measured
first, as `qnpipe bench io` does, in a temp dir next to the model (same disk), with the
store's own record size among the sizes. A throwaway engine runs first, so MLX's first calls
are not in a traced run. Prints progress on stderr and one JSON line on stdout.

    python tools/bench_fidelity.py                            # the bench model of bench_stream.py
    python tools/bench_fidelity.py --rounds 1 --tokens 32 --profile qnpipe-device.json
    # a prefetch run, once replay predicts from the log's recorded candidates (a predictor name):
    python tools/bench_fidelity.py --set predict.cross_layer_prefetch=true --predict NAME
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(f"[bench_fidelity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_stream() -> Any:
    spec = importlib.util.spec_from_file_location("bench_stream", ROOT / "bench_stream.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a qnpipe model directory (default: bench_stream.py's bench model)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"),
                    help="where bench_stream.py caches its model (default /tmp/qnpipe-bench-stream)")
    ap.add_argument("--pool-frac", type=float, default=0.25, help="pool capacity / experts per layer (default 0.25)")
    ap.add_argument("--workers", type=int, default=16, help="read.workers (default 16)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per live run (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="live runs, each fitted and replayed (default 3)")
    ap.add_argument("--profile", type=Path, help="device profile file of `qnpipe bench io` (default: measure now)")
    ap.add_argument("--measure-seconds", type=float, default=0.4, help="seconds per measured cell (default 0.4)")
    ap.add_argument("--measure-mib", type=float, default=1024, help="size of the measurement's files (default 1024)")
    ap.add_argument("--predict", default="none",
                    help="the replay's predictor (qnpipe.replay.PREDICTORS; default none: demand reads, as the "
                    "live run without prefetch)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="another config field of the live run and the replay")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import msgspec

    import qnpipe
    from qnpipe import config
    from qnpipe.io.device_file import load_profile
    from qnpipe.io.measure import measure_profile
    from qnpipe.io.store import ExpertStore
    from qnpipe.replay import replay
    from qnpipe.replay.cost_fit import fit_cost

    model = args.model or bench_stream().make_model(args.work, "bench", 4, 64)
    with ExpertStore.open(model) as store:
        lf = store.layer_file(next(iter(store.layers)))
        experts, record = lf.num_experts, lf.record_nbytes
    slots = max(1, round(experts * args.pool_frac))
    live_set: dict[str, Any] = {"pool.expert_slots": slots, "read.workers": args.workers, "read.nocache": True,
                                "pool.autopin": False, "forward.prefill_chunk_tokens": 0,
                                **dict(kv.split("=", 1) for kv in args.sets)}
    if args.profile:
        measured = load_profile(args.profile)
        log(f"device profile {args.profile}: {measured.profile}")
    else:
        sizes = sorted({13824, 98304, record, 1769472})
        t0 = time.perf_counter()
        measured = measure_profile(Path(model).resolve().parent, records=sizes, qds=(1, 2, 4, 8, 16),
                                   seconds=args.measure_seconds, size_bytes=int(args.measure_mib * 2**20), log=log)
        log(f"measured in {time.perf_counter() - t0:.0f} s: {measured.profile} "
            f"(rms log-rate residual {measured.rate_fit_residual:.3f})")
    device = measured.profile

    with qnpipe.Engine(model, config.load(None, overrides=live_set)) as warm:
        warm.generate([5], max_tokens=8, temperature=1.0, seed=1, stop_at_eos=False)
    rounds = []
    previous = None  # the cost fitted from the round before: for the out-of-sample figure
    with tempfile.TemporaryDirectory(prefix="qnpipe-fidelity-") as tmp:
        for r in range(args.rounds):
            path = Path(tmp) / f"live{r}.qtrace"
            cfg_live = config.load(None, overrides={**live_set, "trace.event_log_path": str(path)})
            with qnpipe.Engine(model, cfg_live) as eng:
                res = eng.generate(bench_stream().round_prompt(r, eng.args.vocab_size), max_tokens=args.tokens,
                                   temperature=1.0, seed=100 + r,
                                   stop_at_eos=False)
                pool = eng.stats().pool
            assert pool is not None
            fit = fit_cost(path, device)
            t0 = time.perf_counter()
            rep = replay(path, config.load(None, overrides=live_set), device_profile=device, cost=fit.cost,
                         predictor=args.predict)
            replay_s = time.perf_counter() - t0
            bare = replay(path, config.load(None, overrides=live_set), device_profile=device,
                          cost=msgspec.structs.replace(fit.cost, read_hop_s=0.0), predictor=args.predict)
            cross = None if previous is None else replay(path, config.load(None, overrides=live_set),
                                                         device_profile=device, cost=previous,
                                                         predictor=args.predict).tok_s
            previous = fit.cost
            live_tok_s = res.stats.decode_tok_s
            causes = sorted(set(pool.misses_by_cause) | set(rep.misses_by_cause))
            miss_err = max(abs(rep.misses_by_cause.get(c, 0) - pool.misses_by_cause.get(c, 0))
                           / max(pool.misses_by_cause.get(c, 0), 1) for c in causes)
            row = {"live_tok_s": round(live_tok_s, 3), "replay_tok_s": round(rep.tok_s, 3),
                   "tok_s_rel_err": round(abs(rep.tok_s - live_tok_s) / live_tok_s, 4),
                   "tok_s_rel_err_without_read_hop": round(abs(bare.tok_s - live_tok_s) / live_tok_s, 4),
                   "tok_s_rel_err_cross": None if cross is None else round(abs(cross - live_tok_s) / live_tok_s, 4),
                   "misses_rel_err": round(miss_err, 4), "live_misses_by_cause": dict(pool.misses_by_cause),
                   "replay_misses_by_cause": rep.misses_by_cause, "steps": rep.steps,
                   "live_stall_s_per_step": round(pool.stall_s / pool.steps, 6),
                   "replay_stall_s_per_step": round(rep.stall_s_per_token, 6),
                   "cost": {"per_layer_s": fit.cost.per_layer_s, "per_token_s": fit.cost.per_token_s,
                            "per_step_s": fit.cost.per_step_s, "read_hop_s": fit.cost.read_hop_s},
                   "cost_rms_residual_s": round(fit.rms_residual_s, 6), "read_hop_rms_residual_s":
                   round(fit.read_hop_rms_residual_s, 6), "replay_wall_s": round(replay_s, 3)}
            rounds.append(row)
            log(f"round {r + 1}/{args.rounds}: live {live_tok_s:.2f} tok/s, replay {rep.tok_s:.2f} "
                f"(err {row['tok_s_rel_err']:.3f}); misses {pool.misses_by_cause} vs {rep.misses_by_cause}; "
                f"stall/step {row['live_stall_s_per_step'] * 1e3:.2f} vs {row['replay_stall_s_per_step'] * 1e3:.2f} ms")
    out = {
        "bench": "fidelity", "model": str(model), "experts_per_layer": experts, "record_nbytes": record,
        "pool_slots_per_layer": slots, "reads_in_flight": args.workers, "tokens": args.tokens, "rounds": args.rounds,
        "misses_rel_err": statistics.median(r["misses_rel_err"] for r in rounds),
        "tok_s_rel_err": statistics.median(r["tok_s_rel_err"] for r in rounds),
        "tok_s_rel_err_without_read_hop": statistics.median(r["tok_s_rel_err_without_read_hop"] for r in rounds),
        "tok_s_rel_err_cross": statistics.median(crossed) if (crossed := [r["tok_s_rel_err_cross"] for r in rounds
                                                                          if r["tok_s_rel_err_cross"] is not None])
        else None,
        "targets": {"misses_rel_err": "<= 0.02", "tok_s_rel_err": "<= 0.15"},
        "device": {"bandwidth_bytes_per_s": device.bandwidth_bytes_per_s, "latency_s": device.latency_s,
                   "per_mb_latency_s": device.per_mb_latency_s, "queue_depth": device.queue_depth,
                   "rate_fit_residual": measured.rate_fit_residual},
        "per_round": rounds,
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
