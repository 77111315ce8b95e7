"""Replay speed: layer-steps per second of `qnpipe.replay` on a synthetic log, prediction on (issue 11).

Writes a synthetic routing log (`qnpipe trace synth`: default 48 MoE layers x 512 experts,
top-10, 1,000 one-token steps, Zipf popularity, some locality and cross-layer correlation)
and replays it `--repeat` times in this process (one core: no threads, no subprocesses),
with the `--predict` predictor (default `previous`), the Qwen3-Next 80B 4-bit record size,
`pool.expert_slots=64` and an 8-slot side region. Prints one JSON line:

  layer_steps_per_s   MoE layer-steps replayed per wall second (the median run); target >= 50,000
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
  digest              sha256 of the report's JSON (the same for the same inputs, before and after
                      any speed-up: the replay must stay byte-identical)

`--profile FILE` also writes a cProfile of one replay (read it with `python -m pstats FILE`).

    python tools/bench_replay.py
    python tools/bench_replay.py --tokens 200 --predict transition --train-frac 0.2 --profile /tmp/replay.prof
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
import trio.testing

from qnpipe import config
from qnpipe.replay import PREDICTORS, PredictorOpts, load_log, predictions, replay, to_json
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
            digests.add(hashlib.sha256(to_json(report).replace(str(log).encode(), b"LOG")).hexdigest())
        if a.profile is not None:
            cProfile.runctx("replay(log, cfg, record_nbytes=RECORD_80B_4BIT, predictor=a.predict, opts=opts)",
                            globals(), {"replay": replay, "log": log, "cfg": cfg, "a": a, "opts": opts,
                                        "RECORD_80B_4BIT": RECORD_80B_4BIT}, str(a.profile))
    if len(digests) != 1:
        print(f"bench_replay: the replays differ ({len(digests)} reports)", file=sys.stderr)
        return 1
    hop_us, jump_us = trio_floor()
    steps = report.steps * a.layers
    wall = statistics.median(walls)
    cpu = statistics.median(cpus)
    out = {"layer_steps_per_s": round(steps / wall, 1), "layer_steps_per_cpu_s": round(steps / cpu, 1),
           "layer_steps": steps, "replay_s": round(wall, 4), "cpu_s": round(cpu, 4),
           "load_s": round(load_s, 4), "predict_s": round(predict_s, 4), "synth_s": round(synth_s, 4), "predictor": a.predict,
           "hit_rate": round(report.hit_rate, 4), "tokens": a.tokens, "layers": a.layers, "experts": a.experts,
           "top_k": a.top_k, "hop_cpu_us": round(hop_us, 2), "jump_cpu_us": round(jump_us, 2),
           "digest": digests.pop()}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
