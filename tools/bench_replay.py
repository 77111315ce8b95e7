"""Replay speed: layer-steps per second of `qnpipe.replay` on a synthetic log, prediction on (issues 11, 24).

Writes a synthetic routing log (`qnpipe trace synth`: default 48 MoE layers x 512 experts,
top-10, 1,000 one-token steps, Zipf popularity, some locality and cross-layer correlation)
and replays it `--repeat` times in this process (one core: no threads, no subprocesses),
with the `--predict` predictor (default `previous`), the Qwen3-Next 80B 4-bit record size,
`pool.expert_slots=64` and an 8-slot side region. Prints one JSON line:

  layer_steps_per_s_fast    MoE layer-steps per CPU second of the heap driver (the default; median run);
                      target >= 50,000
  layer_steps_per_s_actors  ... of the actor driver (trio actors on a virtual clock, the reference), one run
  digest_fast, digest_actors, digests_equal  sha256 of each driver's report: they must be equal
  policy_floor_us_per_layer_step  CPU microseconds of the decision core alone per layer-step (PoolPolicy's
                      acquire, read_done, release and prefetch with the predictor's ranking, reads
                      done at once): what no driver can go below
  requests_per_s_lru_fast   expert requests per CPU second of a demand-only LRU replay of the same log
  requests_per_s_libcachesim, ratio_to_libcachesim  libCacheSim's LRU (one cache of `--slots` objects per
                      layer, fed request by request from Python) on the same request stream, and our
                      rate over it (needs `pip install libcachesim`; null without it)
  layer_steps_per_s   MoE layer-steps replayed per wall second (heap driver, the median run)
  layer_steps_per_cpu_s  ... per second of this process's CPU time (the figure to compare on a
                      loaded machine: other processes' load inflates wall time, far less CPU time)
  layer_steps         layer-steps of one replay (tokens x layers, minus any training steps)
  replay_s            wall seconds of the median replay (load, Belady, predictions and the trio run)
  load_s, predict_s   wall seconds of `load_log` and `predictions` alone (parts of replay_s; the rest
                      is Belady and the actors on the virtual clock)
  synth_s             wall seconds to write the log
  hop_cpu_us, jump_cpu_us  the trio floor, measured here too: CPU microseconds of one message hop
                      between two tasks (half a channel round trip) and of one `trio.sleep` on
                      MockClock(autojump_threshold=0) (a clock jump); a replayed layer-step with a miss
                      makes about ten hops and two jumps
  digest              sha256 of the heap driver's report JSON (the same for the same inputs, before and
                      after any speed-up: the replay must stay byte-identical)

`--profile FILE` also writes a cProfile of one replay (read it with `python -m pstats FILE`).

    python tools/bench_replay.py
    python tools/bench_replay.py --tokens 200 --predict transition --train-frac 0.2 --profile /tmp/replay.prof
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

from qnpipe import config
from qnpipe.policy.build import make_policy
from qnpipe.policy.predict import hint_top, rank
from qnpipe.replay import (
    PREDICTORS,
    PredictorOpts,
    ReplayLog,
    ReplayReport,
    load_log,
    predictions,
    replay,
    replay_capacities,
    to_json,
)
from qnpipe.replay.synth import SynthSpec, write_synth

RECORD_80B_4BIT = 1769472  # one Qwen3-Next-80B expert at 4 bits (tools/bench_io.py)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--locality", type=float, default=0.3)
    p.add_argument("--cross-layer", type=float, default=0.5)
    p.add_argument("--popularity", default="zipf:1.0")
    p.add_argument("--predict", choices=PREDICTORS, default="previous")
    p.add_argument("--train-frac", type=float, default=0.0)
    p.add_argument("--slots", type=int, default=64, help="pool.expert_slots (default 64)")
    p.add_argument("--side", type=int, default=8, help="pool.side_region_slots (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="replays measured; the median is reported (default 3)")
    p.add_argument("--profile", type=Path, default=None, help="write a cProfile of one more replay here")
    return p.parse_args(argv)


def trio_floor(n: int = 5000) -> tuple[float, float]:
    """CPU microseconds of one hop between two tasks and of one virtual-time sleep (MockClock autojump)."""
    async def run() -> tuple[float, float]:
        a_tx, a_rx = trio.open_memory_channel[int](1)
        b_tx, b_rx = trio.open_memory_channel[int](1)

        async def echo() -> None:
            async for m in a_rx:
                b_tx.send_nowait(m)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            c0 = time.process_time()
            for i in range(n):
                a_tx.send_nowait(i)
                await b_rx.receive()
            hop = (time.process_time() - c0) / (2 * n)
            c0 = time.process_time()
            for _ in range(n):
                await trio.sleep(1e-3)
            jump = (time.process_time() - c0) / n
            nursery.cancel_scope.cancel()
        return hop * 1e6, jump * 1e6

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def _digest(report: ReplayReport, log: Path) -> str:
    return hashlib.sha256(to_json(report).replace(str(log).encode(), b"LOG")).hexdigest()


def policy_floor(log: ReplayLog, cfg: config.Config, predictor: str, opts: PredictorOpts) -> float:
    """CPU microseconds per layer-step of the pool policy alone (see the module doc), reads done at once."""
    first = int(len(log.steps) * opts.train_frac)
    preds = predictions(log, predictor, opts, width=cfg.predict.width_experts, first=first) if predictor != "none" \
        else None
    if preds is not None:
        cfg = config.with_overrides(cfg, {"predict.cross_layer_prefetch": True})
    steps = log.steps[first:]
    caps = replay_capacities(cfg, log.shape)
    policy = make_policy(cfg, caps, dict.fromkeys(caps, RECORD_80B_4BIT))
    p = cfg.predict
    top, k = hint_top(p), log.shape.top_k
    c0 = time.process_time()
    for i_step, step in enumerate(steps, start=1):
        for i, (layer, experts) in enumerate(step):
            if preds is not None:
                for target, ids, probs in preds[i_step - 1][i]:
                    ranked = rank(ids.reshape(-1).tolist(), probs.reshape(-1).tolist(), ids.shape[-1],
                                  agg=p.aggregate, union_k=p.union_k, top=top, min_score=p.min_score)
                    for ld in policy.prefetch(i_step, layer, target, ranked):
                        policy.read_done(target, ld.expert, ld.slot)
            key = (i_step, layer, 0)
            acq = policy.acquire(key, tuple(dict.fromkeys(experts[:k] if len(experts) == k else experts)), 0.0)
            for ld in acq.loads:
                policy.read_done(layer, ld.expert, ld.slot)
            policy.release(key)
        policy.forward_done()
    return (time.process_time() - c0) / (len(steps) * len(log.shape.moe_layers)) * 1e6


def libcachesim_lru_rate(log: ReplayLog, slots: int, first: int) -> float | None:
    """Requests per CPU second of libCacheSim's LRU on the log's demand stream (one cache per layer), or None."""
    try:  # the benchmark's only use of it, not a dependency: `pip install libcachesim`
        lcs: Any = importlib.import_module("libcachesim")
    except ImportError:
        return None
    caches = {layer: lcs.LRU(slots) for layer in log.shape.moe_layers}
    stream = [(layer, e) for step in log.steps[first:] for layer, experts in step for e in dict.fromkeys(experts)]
    req = lcs.Request()
    req.obj_size = 1
    c0 = time.process_time()
    for layer, e in stream:
        req.obj_id = e
        caches[layer].get(req)
    return len(stream) / (time.process_time() - c0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    spec = SynthSpec(layers=a.layers, experts=a.experts, top_k=a.top_k, tokens=a.tokens, seed=a.seed,
                     locality=a.locality, cross_layer=a.cross_layer, popularity=a.popularity)
    cfg = config.load(None, overrides={"pool.expert_slots": str(a.slots), "pool.side_region_slots": str(a.side)})
    opts = PredictorOpts(train_frac=a.train_frac)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "synth.qtrace"
        t0 = time.perf_counter()
        write_synth(log, spec)
        synth_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        loaded = load_log(log)
        load_s = time.perf_counter() - t0
        predict_s = 0.0
        if a.predict != "none":
            t0 = time.perf_counter()
            predictions(loaded, a.predict, opts, width=cfg.predict.width_experts,
                        first=int(len(loaded.steps) * a.train_frac))
            predict_s = time.perf_counter() - t0
        walls, cpus, digests = [], [], set()
        for _ in range(a.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            report = replay(log, cfg, record_nbytes=RECORD_80B_4BIT, predictor=a.predict, opts=opts)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            digests.add(_digest(report, log))
        c0 = time.process_time()
        actors = replay(log, cfg, record_nbytes=RECORD_80B_4BIT, predictor=a.predict, opts=opts, driver="actors")
        actors_cpu = time.process_time() - c0
        digest_actors = _digest(actors, log)
        floor_us = policy_floor(loaded, cfg, a.predict, opts)
        lru_cfg = config.load(None, overrides={"pool.expert_slots": str(a.slots), "pool.evict_policy": "lru"})
        c0 = time.process_time()
        lru = replay(log, lru_cfg, record_nbytes=RECORD_80B_4BIT, opts=opts)
        lru_cpu = time.process_time() - c0
        lru_requests = sum(x.requests for x in lru.layers)
        lcs_rate = libcachesim_lru_rate(loaded, a.slots, int(len(loaded.steps) * a.train_frac))
        if a.profile is not None:
            cProfile.runctx("replay(log, cfg, record_nbytes=RECORD_80B_4BIT, predictor=a.predict, opts=opts)",
                            globals(), {"replay": replay, "log": log, "cfg": cfg, "a": a, "opts": opts,
                                        "RECORD_80B_4BIT": RECORD_80B_4BIT}, str(a.profile))
    if len(digests) != 1:
        print(f"bench_replay: the replays differ ({len(digests)} reports)", file=sys.stderr)
        return 1
    if digests != {digest_actors}:
        print("bench_replay: the heap driver's report differs from the actor driver's", file=sys.stderr)
    hop_us, jump_us = trio_floor()
    steps = report.steps * a.layers
    wall = statistics.median(walls)
    cpu = statistics.median(cpus)
    digest = digests.pop()
    out = {"layer_steps_per_s_fast": round(steps / cpu, 1), "layer_steps_per_s_actors": round(steps / actors_cpu, 1),
           "digest_fast": digest, "digest_actors": digest_actors, "digests_equal": digest == digest_actors,
           "policy_floor_us_per_layer_step": round(floor_us, 2),
           "requests_per_s_lru_fast": round(lru_requests / lru_cpu, 1),
           "requests_per_s_libcachesim": None if lcs_rate is None else round(lcs_rate, 1),
           "ratio_to_libcachesim": None if lcs_rate is None else round(lru_requests / lru_cpu / lcs_rate, 4),
           "layer_steps_per_s": round(steps / wall, 1), "layer_steps_per_cpu_s": round(steps / cpu, 1),
           "layer_steps": steps, "replay_s": round(wall, 4), "cpu_s": round(cpu, 4),
           "load_s": round(load_s, 4), "predict_s": round(predict_s, 4), "synth_s": round(synth_s, 4), "predictor": a.predict,
           "hit_rate": round(report.hit_rate, 4), "tokens": a.tokens, "layers": a.layers, "experts": a.experts,
           "top_k": a.top_k, "hop_cpu_us": round(hop_us, 2), "jump_cpu_us": round(jump_us, 2),
           "digest": digest}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
