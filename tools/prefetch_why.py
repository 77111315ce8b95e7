"""Why prefetch does (not) pay on this machine, from the event logs, and what would make it pay (issue 10).

Opens two engines on the bench model of tools/bench_stream.py (the same pool at `--pool-frac`
of each layer's experts, direct I/O, `read.workers` in flight): `demand` (demand reads only) and
`prefetch` (prediction, side region and scheduler on, bench_stream's prefetch settings), each
writing an event log (`trace.event_log_path`), and runs them interleaved, round by round, with
the same prompts and sampling seeds (so the same tokens and routes). Then, from the two logs:

* misses, recall and useful prefetches: the engines' own attribution (`Engine.stats().pool`),
  beside what the log's reads say (bytes per token by class, demand reads per token);
* `demand_read_ms`: per demand read, the scheduler's start of it to its `read.done` (the
  device plus the thread hand-offs), median, in each run; `prefetch_in_flight_at_demand`:
  how many prefetch reads were on the device when a demand read started (mean), and the
  share of demand reads that started with at least one there;
* `cost_fit`: `qnpipe trace fit-cost` of each log against this device's profile (below);
  `layer_ms`: a one-token MoE layer's compute and bookkeeping from it (the prefetch run's
  includes its gate matmuls for prediction and the hand-offs of its loop's own thread), and
  `read_hop_s` (a read
  batch's time beyond the modelled device: in the prefetch run, demand reads that queue
  behind prefetches on the device show up here);
* `replay`: the prefetch run's log replayed (`qnpipe.replay`, virtual time, the demand run's
  fitted cost) on this device's profile and on `apple-m5-internal` (with this machine's read
  hop, and without it: `apple-m5-internal_no_hop`), demand only (`none`), with
  the run's own predictions (`recorded`), and with an oracle at the run's recall (the same
  hits, no wasted reads) and at recall 1: tokens per (virtual) second and the ratio to `none`.
  That is what would make prefetch pay, each cause taken away in turn.

The device profile: cold random reads of the store's own records at queue depths 1..16
(bench_stream's `bench_bandwidth`), `bandwidth_bytes_per_s` = the record bytes per second of
one read alone, `queue_depth` = the 16-deep rate over the 1-deep (rounded, at least 1).

Prints progress on stderr and one JSON line on stdout, with `why`: the figures in sentences.

    python tools/prefetch_why.py                        # bench model of tools/bench_stream.py
    python tools/prefetch_why.py --rounds 3 --tokens 32 --logs /tmp/why   # keep the two event logs
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_stream  # noqa: E402  (tools/ is not a package)

from qnpipe.messages import ForwardDone, Promote, ReadDone, ReadExpert  # noqa: E402
from qnpipe.policy.read_queue import ReadClass  # noqa: E402
from qnpipe.trace import Record, Stalled  # noqa: E402


def log(msg: str) -> None:
    print(f"[prefetch_why {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ReadFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What one event log's reads say, per forward step (`steps`: its `pool.forward_done` records)."""

    steps: int
    demand_reads: int
    prefetch_reads: int
    demand_bytes_per_step: float
    prefetch_bytes_per_step: float
    stall_ms_per_step: float
    demand_read_ms: float  # median, scheduler start -> read.done
    demand_reads_per_batch: float  # mean (a batch: the demand reads the scheduler started at one time)
    prefetch_in_flight_at_demand: float  # mean prefetch reads on the device when a demand read started
    demand_behind_prefetch: float  # share of demand reads that started with a prefetch on the device


def read_figures(records: Iterable[Record]) -> ReadFigures:
    """The reads of one log by class. A read's class is that of its first request since the key's
    last `read.done`; a `read.promote` (a step now waits on a queued prefetch) makes it demand."""
    cls: dict[tuple[int, int], ReadClass] = {}
    done: list[tuple[ReadClass, float, float, int]] = []  # (class, started, done, nbytes)
    steps = 0
    stall = 0.0
    for r in records:
        if isinstance(r, ReadExpert):
            cls.setdefault((r.layer, r.expert), r.cls)
        elif isinstance(r, Promote):
            if (r.layer, r.expert) in cls:
                cls[(r.layer, r.expert)] = ReadClass.DEMAND
        elif isinstance(r, ReadDone):
            c = cls.pop((r.layer, r.expert), ReadClass.DEMAND)
            done.append((c, r.started_t, r.t, r.nbytes))
        elif isinstance(r, ForwardDone):
            steps += 1
        elif isinstance(r, Stalled):
            stall += r.waited_s
    demand = [d for d in done if d[0] is ReadClass.DEMAND]
    prefetch = [d for d in done if d[0] is ReadClass.PREFETCH]
    in_flight = prefetch_in_flight([(s, e) for _, s, e, _ in prefetch], [s for _, s, _, _ in demand])
    n = max(steps, 1)
    return ReadFigures(
        steps=steps, demand_reads=len(demand), prefetch_reads=len(prefetch),
        demand_bytes_per_step=sum(d[3] for d in demand) / n, prefetch_bytes_per_step=sum(d[3] for d in prefetch) / n,
        stall_ms_per_step=stall / n * 1e3,
        demand_read_ms=statistics.median([e - s for _, s, e, _ in demand]) * 1e3 if demand else 0.0,
        demand_reads_per_batch=len(demand) / len({s for _, s, _, _ in demand}) if demand else 0.0,
        prefetch_in_flight_at_demand=statistics.mean(in_flight) if in_flight else 0.0,
        demand_behind_prefetch=sum(k > 0 for k in in_flight) / len(in_flight) if in_flight else 0.0)


def prefetch_in_flight(intervals: Sequence[tuple[float, float]], starts: Sequence[float]) -> list[int]:
    """For each of `starts`, how many of `intervals` [start, end) hold it."""
    begins = sorted(s for s, _ in intervals)
    ends = sorted(e for _, e in intervals)
    return [bisect.bisect_right(begins, t) - bisect.bisect_right(ends, t) for t in starts]


def device_profile(model_dir: Path, seconds: float, backend: str) -> tuple[Any, dict[int, float]]:
    """The `DeviceProfile` of this disk for the store's records (see the module doc) and the GB/s by depth."""
    from qnpipe.io.simssd import DeviceProfile

    gbps = {qd: bench_stream.bench_bandwidth(model_dir, qd, seconds, seed=qd, backend=backend)["gbps"]
            for qd in (1, 2, 4, 8, 16)}
    one = gbps[1] * 1e9
    return DeviceProfile(bandwidth_bytes_per_s=one, latency_s=0.0,
                         queue_depth=max(1, round(gbps[16] / gbps[1]))), gbps


def replay_table(prefetch_log: Path, cfg: Any, devices: dict[str, tuple[Any, Any]], recall: float) -> dict[str, Any]:
    """tok/s of the prefetch run's log replayed per device (name -> (profile, cost)) and predictor, and each over `none`."""
    from qnpipe.replay import PredictorOpts, replay

    cases = {"none": ("none", None), "recorded": ("recorded", None),
             "oracle_same_recall": ("oracle", PredictorOpts(recall=recall)), "oracle_recall_1": ("oracle", PredictorOpts())}
    out: dict[str, Any] = {}
    for name, (dev, cost) in devices.items():
        row: dict[str, Any] = {}
        for case, (pred, opts) in cases.items():
            r = replay(prefetch_log, cfg, device_profile=dev, cost=cost, predictor=pred, opts=opts)
            row[case] = {"tok_s": round(r.tok_s, 3), "misses_per_token": round(sum(r.misses_by_cause.values()) / r.steps, 2),
                         "mb_per_token": round(r.bytes_per_token / 1e6, 2),
                         "stall_ms_per_token": round(r.stall_s_per_token * 1e3, 2)}
        for case in cases:
            row[case]["ratio_to_none"] = round(row[case]["tok_s"] / row["none"]["tok_s"], 3)
        out[name] = row
    return out


def why(res: dict[str, Any]) -> list[str]:
    """The figures in sentences (what the JSON says, for a reader)."""
    f, d = res["reads"]["prefetch"], res["reads"]["demand"]
    here = res["replay"]["this_device"]
    extra = (f["demand_bytes_per_step"] + f["prefetch_bytes_per_step"] - d["demand_bytes_per_step"]) / 1e6
    out = [
        f"prefetch ran at {res['ratio_prefetch_to_demand']:.2f}x demand: misses {res['misses_per_token_demand']:.1f} -> "
        f"{res['misses_per_token_prefetch']:.1f} per token, but only {res['useful_prefetch_ratio']:.0%} of the "
        f"prefetches were used, so {extra:.1f} MB more per token were read on a "
        f"{res['bandwidth_gbps'][16]:.2f} GB/s (16 deep) device",
        f"demand reads took {f['demand_read_ms']:.2f} ms (median) in batches of {f['demand_reads_per_batch']:.1f} in "
        f"the prefetch run, against {d['demand_read_ms']:.2f} ms in batches of {d['demand_reads_per_batch']:.1f} in the "
        f"demand run: {f['demand_behind_prefetch']:.0%} of them started with prefetches on the device "
        f"({f['prefetch_in_flight_at_demand']:.1f} on average), which serves reads first come first served",
        f"a one-token MoE layer costs {res['layer_ms']['prefetch']:.2f} ms in the prefetch run against "
        f"{res['layer_ms']['demand']:.2f} (its gate matmuls for prediction and the hand-offs of its loop's own "
        f"thread); a read batch's hop beyond the modelled device {res['cost_fit']['prefetch']['read_hop_s'] * 1e3:.2f} ms "
        f"against {res['cost_fit']['demand']['read_hop_s'] * 1e3:.2f}",
        f"replayed on this device's profile with the demand run's costs, the run's own predictions give "
        f"{here['recorded']['ratio_to_none']:.2f}x demand; the same recall without wasted reads "
        f"{here['oracle_same_recall']['ratio_to_none']:.2f}x; every expert predicted "
        f"{here['oracle_recall_1']['ratio_to_none']:.2f}x",
    ]
    m5, m5_free = res["replay"]["apple-m5-internal"], res["replay"]["apple-m5-internal_no_hop"]
    out.append(f"on apple-m5-internal (6.8 GB/s) the same log gives {m5['recorded']['ratio_to_none']:.2f}x with its "
               f"own predictions and {m5['oracle_recall_1']['ratio_to_none']:.2f}x with every expert predicted, still "
               f"paying this machine's read hop per batch; without it, {m5_free['recorded']['ratio_to_none']:.2f}x and "
               f"{m5_free['oracle_recall_1']['ratio_to_none']:.2f}x: demand reads there stall "
               f"{m5_free['none']['stall_ms_per_token']:.1f} ms per token, so there is little left to hide")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a qnpipe model directory (default: bench_stream's, made under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"))
    ap.add_argument("--shape", choices=sorted(bench_stream.SHAPES), default="bench")
    ap.add_argument("--pool-frac", type=float, default=0.25)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--backend", default="c")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per generate call (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", type=int, default=16, help="pool.side_region_slots of the prefetch run (default 16)")
    ap.add_argument("--width", type=int, default=12, help="predict.width_experts (default 12)")
    ap.add_argument("--per-layer-budget", type=int, default=12, help="predict.per_layer_budget_experts (default 12)")
    ap.add_argument("--bw-seconds", type=float, default=1.0, help="seconds per queue depth of the device profile")
    ap.add_argument("--logs", type=Path, default=None, help="keep the two event logs in this directory")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import qnpipe
    from qnpipe import config as config_mod
    from qnpipe.io.simssd import PROFILES
    from qnpipe.io.store import ExpertStore
    from qnpipe.replay.cost_fit import fit_cost
    from qnpipe.trace import read

    model_dir = args.model or bench_stream.make_model(args.work, args.shape, 4, 64)
    with ExpertStore.open(model_dir) as store:
        lf0 = store.layer_file(next(iter(store.layers)))
        num_experts, record_nbytes = lf0.num_experts, lf0.record_nbytes
    slots = max(1, round(num_experts * args.pool_frac))
    tmp = None
    if args.logs is None:
        tmp = tempfile.TemporaryDirectory(prefix="qnpipe-why-")
        logs = Path(tmp.name)
    else:
        logs = args.logs
        logs.mkdir(parents=True, exist_ok=True)
    paths = {name: logs / f"{name}.qtrace" for name in ("demand", "prefetch")}
    read_cfg: dict[str, Any] = {"read.workers": args.workers, "read.nocache": True, "read.backend": args.backend, "pool.autopin": False}
    prefetch_cfg: dict[str, Any] = {"predict.cross_layer_prefetch": True, "pool.side_region_slots": args.side,
                    "predict.width_experts": args.width, "predict.per_layer_budget_experts": args.per_layer_budget}
    kw: dict[str, dict[str, Any]] = {
        "demand": {**read_cfg, "trace.event_log_path": str(paths["demand"])},
        "prefetch": {**read_cfg, **prefetch_cfg, "trace.event_log_path": str(paths["prefetch"])},
    }
    engines = {name: qnpipe.Engine(model_dir, expert_slots=slots, prefill_chunk_tokens=0, **kw[name]) for name in kw}
    vocab = engines["demand"].args.vocab_size
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for e in engines.values():
            e.generate([3, 4, 5, 6], max_tokens=4, temperature=1.0, seed=1, stop_at_eos=False)  # code paths warm
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            toks = {}
            for name in order:
                res = engines[name].generate(bench_stream.round_prompt(r, vocab), max_tokens=args.tokens, temperature=1.0, seed=100 + r,
                                             stop_at_eos=False)
                tok_s[name].append(res.stats.decode_tok_s)
                toks[name] = res.tokens
            log(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {tok_s[n][-1]:.2f} tok/s" for n in engines)
                + ("" if toks["demand"] == toks["prefetch"] else "  (tokens differ!)"))
        pools = {name: e.stats().pool for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()  # ends the event logs
    assert pools["demand"] is not None and pools["prefetch"] is not None
    figures = {name: read_figures(read(p)[1]) for name, p in paths.items()}
    log("device profile: cold random reads at depths 1..16")
    profile, gbps = device_profile(model_dir, args.bw_seconds, args.backend)
    fits = {name: fit_cost(p, profile) for name, p in paths.items()}
    cfg = config_mod.with_overrides(config_mod.Config(), {"pool.expert_slots": slots, **read_cfg, **prefetch_cfg})
    cfg = config_mod.with_overrides(cfg, {"predict.cross_layer_prefetch": False})
    recall = pools["prefetch"].prefetch_recall
    log("replaying the prefetch run's log")
    cost = fits["demand"].cost
    m5 = PROFILES["apple-m5-internal"]
    table = replay_table(paths["prefetch"], cfg, {"this_device": (profile, cost), "apple-m5-internal": (m5, cost),
                                                  "apple-m5-internal_no_hop": (m5, msgspec.structs.replace(cost, read_hop_s=0.0))},
                         recall)
    steps = {name: max(1, figures[name].steps) for name in figures}
    med = {name: statistics.median(v) for name, v in tok_s.items()}
    out: dict[str, Any] = {
        "bench": "prefetch_why", "model": str(model_dir), "pool_slots_per_layer": slots, "record_nbytes": record_nbytes,
        "rounds": args.rounds, "tokens_per_round": args.tokens,
        "tok_s_demand": round(med["demand"], 3), "tok_s_prefetch": round(med["prefetch"], 3),
        "ratio_prefetch_to_demand": round(statistics.median(
            [p / d for p, d in zip(tok_s["prefetch"], tok_s["demand"], strict=True)]), 3),
        "misses_per_token_demand": round(pools["demand"].misses / steps["demand"], 2),
        "misses_per_token_prefetch": round(pools["prefetch"].misses / steps["prefetch"], 2),
        "misses_by_cause_prefetch": dict(pools["prefetch"].misses_by_cause),
        "prefetch_recall": round(recall, 4), "useful_prefetch_ratio": round(pools["prefetch"].useful_prefetch_ratio, 4),
        "reads": {name: msgspec.to_builtins(f) for name, f in figures.items()},
        "bandwidth_gbps": {qd: round(v, 3) for qd, v in gbps.items()},
        "device_profile": msgspec.to_builtins(profile),
        "cost_fit": {name: msgspec.to_builtins(f.cost) for name, f in fits.items()},
        "layer_ms": {name: round(f.cost.layer_s(1) * 1e3, 3) for name, f in fits.items()},
        "replay": table,
    }
    out["why"] = why(out)
    for line in out["why"]:
        log(line)
    print(json.dumps(out))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
