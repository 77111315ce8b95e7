"""Streamed decode against its serial bound: all-resident vs the expert pool with demand reads (issue 9).

Makes (or takes `--model`) a qnpipe model directory sized for a small machine (default
16 MoE layers x 128 experts, top-8, 4-bit records of ~310 KB, cached under `--work`), opens
three engines on it side by side and runs them interleaved, round by round, with the same
prompt and sampling seed (so the same tokens and routes):

  resident  `eager_load=True`: every expert in memory, no actors (the reference step time)
  demand    the pool at `--pool-frac` (25%) of each layer's experts, direct I/O
            (`read.nocache`), `read.workers` reads in flight; reads are demand reads only
            (the pipeline has no prefetch)
  allhit    the pool at every expert (capacity = num_experts), warmed up before the
            rounds: the streaming pipeline with no misses, to isolate its overhead

and, in the same rounds, the device bandwidth: cold random reads of the store's own
records (uniform over (layer, expert), record_nbytes each at their offsets) through
`SsdReader` with `read.workers` workers and as many reads in flight (two submitter
threads, batches of 4 x workers, as tools/bench_io.py), for `--bw-seconds`.
Each round also measures the bandwidth at the depth the demand run really has (the mean
misses per layer-step, rounded up): `bw_at_effective_qd_gbps`, for reference only.

What is measured (every figure is a median over `--rounds`):

* `tok_s_*`: the steady decode rate: the tokens committed after the first up to the next-to-last,
  over the time between those commits (`steady_tok_s`: `DecodeSession.commit` timed here). Not
  `GenerateStats.decode_tok_s` (first to last, `decode_tok_s_*`): on MLX's CPU backend the resident
  engine's first token is read only after the step queued behind it is done too, and its last right
  after the one before, so there it counts n - 1 tokens over n - 2 steps, 1/(n - 2) too fast
  (4.5 % at 24 tokens; every resident-relative key below had that bias until 2026-12-05).
* per-token pool figures (`misses_per_token`, `missed_bytes_per_token`, `hit_rate`): the
  deltas of `eng.stats().pool` over one whole `generate` call, divided by its forward steps
  (`pool.steps` delta). The prompt is ONE token, so the prefill is a 1-token step like every
  decode step (it is counted; nothing else is). Each round uses a different prompt token
  and sampling seed (temperature 1) so the routes do not settle into a greedy loop.
* `tok_s_serial_bound` = 1 / (resident step time + missed bytes per token / bandwidth):
  what a pipeline would reach that reads every miss at the device's bandwidth at
  `read.workers` in flight and has no overhead and no overlap of compute with I/O.
  GB/s here counts record bytes (1e9 bytes/s), as `pool.bytes_read` does. Computed per
  round (that round's resident step, demand misses and bandwidth), then the median.
  `tok_s_serial_bound_own_compute` puts the demand run's own `mlx` time in place of the
  resident step (robust to load changing between the runs on a shared machine).
* The step-time breakdown (seconds per token, over the whole `generate` call divided by
  its steps; instruments installed from this script, the engine code is unchanged):
    - `wall`: the caller's wall time of `generate` / steps
    - `mlx`: time inside `MlxBackend.begin/resume` and the token read (`decoding._item`)
      on the MLX thread: the model's compute, including the per-layer `mx.eval` syncs
    - `hop`: time the forward spends awaiting `ThreadedBackend.begin/resume` minus the
      part of `mlx` they ran: the sync Engine's loop runs on the MLX thread, so the calls
      are inline and this is the turn given to the other tasks after each
    - `device`: the union of the intervals in which a batch is on the device: `SsdReader.read_batch`
      running, or from `SsdReader.start` having queued the batch to its last read's end (the C reader's
      own clock reading; the loop's wake-up after it is overhead)
    - `stall`: `pool.stall_s` delta: forward waiting for grants that had misses (device +
      the pool / read-scheduler messaging and thread hand-offs on the miss path)
    - `overhead` = wall - the union of the intervals inside an MLX call (the two above) or a
      read batch: everything that is neither compute on the loop thread nor a read in
      progress: actor messaging (Acquire/Granted/Release/ReadExperts/ReadsDone), trio
      scheduling, thread hand-offs (the submitter threads of the reads), the pool's and
      forward's bookkeeping, the decode loop. (`overhead_sum` = wall - mlx - device, which
      counts twice the time a read runs during an MLX call, as with early grants or prefetch;
      `overhead_frac_sum` is its fraction, the definition before 2026-12-01's evening.)
    - `loop_work`: the CPU time of the thread whose trio loop runs the engine's pipeline (the
      MLX thread, qnpipe.live.mlx_thread, minus the CPU of the MLX calls inline there, taken apart
      inside the same wrappers, but not the forward's turns for hits that run inside them,
      `Forward.hit_slots` / `hit_queued`, timed apart; with prefetch on, the engine's own loop
      thread): the actors' and the decode loop's own work, measured directly. (A trio instrument summing task steps measured the same but cost
      3.6 % of demand tok/s itself, side by side.)
* `overhead_frac_from_first_read`: the same with each batch counted on the device only from when one of the
  reader's threads took its first read (`PendingRead.t_started`, the C reader's clock), not from when the loop
  handed it over: the thread hand-off's delay is the pipeline's too. `read_take_delay_us`: that delay, the
  median over the demand run's batches (per round, then the median); negative when a thread took the first
  read before the hand-over call returned (the batch is then on the device earlier than `overhead_frac` says).
* `overhead_frac` = demand overhead / demand wall (the direct measurement above). A batch started from the loop
  (`SsdReader.start`, `start_at`) is on the device from the hand-over call's return, or from its first read when a
  reader thread took that before the call returned: the woken reader was run first on the loop's CPU (on two
  cores, ~40 % of a demand run's batches, the call then lasting ~190 µs while the reads are in flight).
  `overhead_frac_handover` counts every batch from the call's return only (`overhead_frac` until 2026-12-05,
  late): with the loop and the reader threads pinned to different CPUs it was 0.011 lower at the same wall time,
  so it measured where the scheduler put the readers, not the pipeline's work. Since early
  grants (qnpipe.actors.forward) the hits' compute of a layer runs in the background during
  its reads, outside `mlx`: what of it does not fall within `device` is counted here, so
  this is an upper bound. `overhead_frac_loop` = demand `loop_work` / wall: the actors'
  own work alone (part of it runs while MLX computes in the background). The
  `_own_compute` bound likewise undercounts compute since then (it only sees `mlx`).
  `overhead_frac_allhit` = (allhit step - resident step) / allhit step, from `tok_s`:
  the streaming pipeline with every access a hit against the model run straight through
  (this also contains what the streamed decode loses by not queueing the next step
  before reading the token, see qnpipe.live.decoding). `overhead_frac_allhit_direct` is
  (wall - mlx) / wall of the allhit run.
* `pipeline_us_per_layer_step_allhit` = (1/tok_s_allhit - 1/tok_s_resident) / MoE layers, in µs, per
  round then the median (`_raw`: each round's); `ratio_allhit_to_resident` the tok/s ratio;
  `pipeline_cpu_us_per_layer_step_allhit` the same from the loop thread's CPU (`loop_work`), which
  a loaded machine disturbs far less. The `_channel` keys are the same for the `allhit_channel`
  engine, whose hits go through the pool actor's channels (`qnpipe.actors.pipeline._inline_hits`
  off: the path before hits were answered in the forward's turn); `--no-channel` skips it. The `_turn`
  keys (`--turn-ab`) are the `allhit_turn` engine's: hits answered in the forward's turn once the
  backend has yielded the route, the sampled token read before the next step (the path before hits
  ran before their turn, qnpipe.actors.forward `hit_slots`).
* `--allhit-only`: resident and the all-hit engines alone, the keys above; with `--shape ms1`
  (the bench shape at a quarter of the hidden size and of the experts' width, 2 attention heads:
  ~1 ms of compute per layer-step on this VM, about a GPU's pace on the 80B, instead of ~6) it
  also prints `ratio_allhit_to_resident_1ms` and `resident_ms_per_layer_step` says the pace reached.
* `read_batches_per_token`: `read_batch` calls per token (read scheduler `batches`); equal to
  `reads_per_token` means every miss went to the device on its own (one trio task and one
  `trio.to_thread` hand-off each), not as one batch per layer.
* `pipeline_alone_us_per_layer_step`: the forward, pool and read-scheduler actors with no
  model and no disk (a backend that routes uniformly at random at once, a device that
  completes reads at once; `demand_to_thread` passes each read batch through
  `trio.to_thread`): their own wall and process-CPU time per layer-step, the best of 3 runs
  of 200 steps. Actor messaging and bookkeeping, isolated, run back to back.
  `demand_bursts`: the same with each layer's compute as a 5 ms idle wait (`trio.sleep`, the
  wall figure is what lies beyond it), as in a decode, where the loop thread waits for MLX
  and the disk between one layer-step's burst of actor work and the next: on this VM the
  same work then costs several times its back-to-back time (cold caches after an idle wait).
  `overhead_frac_alone` and `overhead_frac_alone_bursts` = that CPU per layer-step x the
  demand run's layer-steps per token / the demand run's wall per token (CPU, not wall: a
  `trio.sleep` wakes 0.1-0.2 ms late here, which is not the actors' doing).
* `floor_us_per_layer_step`: the messages of one demand layer-step with no bookkeeping at all
  (forward -> pool -> scheduler -> a thread and back -> pool -> forward, twice, and a
  release; `bench_floor`), back to back and after 5 ms idle waits; `overhead_frac_floor_bursts`
  = its CPU in bursts x layer-steps per token / the demand wall: what the fixed design (trio
  actors, one thread hand-off per read batch) costs on this machine before any bookkeeping.
* On a shared machine the step times drift between runs: every round runs the engines back
  to back in alternating order (ABC, CBA, ...), ratios are formed per round, then the median;
  `loadavg_start_end` records the load.
* `pipeline_us_per_layer_step_demand` = the demand run's `overhead` per token / its layer-steps per
  token, in µs (the median over rounds).
* `--miss-ab`: a `demand_before` engine, the same demand pool with the miss path as it was before
  2026-12-05 (each read batch on a submitter thread, `qnpipe.io.device._start_reads`; every actor turn
  by channel, `qnpipe.actors.pipeline._inline_reads`; no yield before an early grant's hits,
  `qnpipe.actors.forward._reads_first`; the other tasks' turn before a route's acquire,
  `qnpipe.actors.forward._route_turn_first`), in the same rounds: the `_before` keys,
  `ratio_demand_to_demand_before` (tok/s, per round then the median) and each round's
  `overhead_frac_raw` / `overhead_frac_before_raw`.
* `--acquire-ab`: a `demand_acquire_channel` engine, the same demand pool with an acquire with misses sent
  to the pool actor by channel (`qnpipe.actors.pipeline._inline_acquires` off; the rest of the miss path as
  today), in the same rounds: `tok_s_demand_acquire_channel`, `overhead_frac_acquire_channel`,
  `ratio_demand_to_demand_acquire_channel` (tok/s, per round then the median) and the rounds' `_raw` fractions.
* `--route-ab`: likewise a `demand_route_later` engine, whose backend gives the other tasks their turn as it
  returns a route, before the forward's acquire (`qnpipe.actors.forward._route_turn_first` off): the
  `_route_later` keys.
* `--targets-ab`: likewise a `demand_targets_off` engine, whose device builds a `ReadRequest` and a plan per
  read rather than putting each read at its slot's target planned once (`qnpipe.io.device._in_place` off): the
  `_targets_off` keys.
* `--c-acquire-ab`: likewise a `demand_python_acquire` engine, whose slot tables acquire in Python rather
  than in C (`qnpipe.policy.slot_table._c_acquire` off around its runs; the `--miss-ab` engine's too): the
  `_python_acquire` keys.
* `--yield-ab`: likewise a `demand_no_yield` engine, whose loop goes on with its turn after handing a batch to
  the reader's threads instead of yielding its CPU once (`qnpipe.io.pending._yield_after_start` off around its runs;
  the `--miss-ab` engine's too): the `_no_yield` keys.
* `--own-reads-ab`: likewise a `demand_others_wait` engine, whose demand batches are waited for by the read
  scheduler's task, which hands the grant to the forward by channel, rather than by the forward itself
  (`qnpipe.actors.forward._wait_own_reads` off around its runs; the `--miss-ab` engine's too): the `_others_wait` keys.
* `--landed-ab`: likewise a `demand_grant_first` engine, whose grants are taken (the read scheduler's and the
  pool's turns over the reads' end) before the backend runs them rather than in its call once its work is queued
  (`qnpipe.actors.forward._landed_grants` off around its runs; the `--miss-ab` engine's too): the `_grant_first`
  keys. The overhead such a turn leaves is inside an MLX call, so `overhead_frac` no longer counts it: compare
  the tok/s ratio too.
* `--reads-first-ab`: likewise a `demand_reads_after_turn` engine, whose acquires with misses put their reads on
  the device after the pool's whole turn rather than once the slot table has chosen their slots
  (`qnpipe.actors.pool._reads_first` off around its runs; the `--miss-ab` engine's too): the `_reads_after_turn`
  keys.
* `--foresee-ab`: likewise a `demand_foresee_late` engine, whose grant run before its turn is foreseen once its
  reads are done rather than while they are on the device (`qnpipe.actors.forward._foresee_early` off around its
  runs; the `--miss-ab` engine's too): the `_foresee_late` keys.
* `--submit-first-ab`: likewise a `demand_submit_after_turn` engine, whose demand batch known before the read
  scheduler's turn (`ReadCore.batch_at_once`) goes on the device in that turn, after its bookkeeping, rather than
  before it (`qnpipe.actors.read_scheduler._submit_first` off around its runs; the `--miss-ab` engine's too): the
  `_submit_after_turn` keys.
* `ratio_demand_to_serial_bound` = tok_s_demand / tok_s_serial_bound (target >= 0.9);
  `overhead_frac` target < 0.05.

Prints progress on stderr and one JSON line on stdout.

    python tools/bench_stream.py                        # make / reuse the bench model in /tmp/qnpipe-bench-stream
    python tools/bench_stream.py --rounds 3 --tokens 32 # shorter
    python tools/bench_stream.py --no-prefetch --no-channel --no-allhit --miss-ab --rounds 8 --tokens 24  # miss path
    python tools/bench_stream.py --model DIR            # an existing qnpipe model directory
    python tools/bench_stream.py --profile              # also a cProfile of the engine loop thread (demand)
    python tools/bench_stream.py --allhit-only --rounds 8 --tokens 24             # the pipeline's cost per hit
    python tools/bench_stream.py --shape ms1 --allhit-only --rounds 10 --tokens 32  # ... at ~1 ms a layer
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import trio

SHAPES: dict[str, dict[str, Any]] = {
    # ~310 KB records at 4 bits / group 64 (3 x (512 x 384 / 2 + 2 x 2 x 512 x 384 / 64) bytes);
    # store 16 x 128 x 310 KB = 0.64 GB; HF float32 source ~4.8 GB (removed after converting).
    "bench": {"hidden_size": 512, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 384,
              "num_hidden_layers": 16, "full_attention_interval": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64,
              "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 1024,
              "mtp_num_hidden_layers": 0},
    # The all-hit variant at ~1 ms per layer-step (a GPU's pace on an 80B): the bench shape with a quarter of
    # the hidden size and of the experts' width, so the model's compute per layer is ~1/6 of the bench's.
    "ms1": {"hidden_size": 128, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 96,
            "num_hidden_layers": 16, "full_attention_interval": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "linear_num_key_heads": 1, "linear_num_value_heads": 1,
            "linear_key_head_dim": 64, "linear_value_head_dim": 64,
            "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 1024,
            "mtp_num_hidden_layers": 0},
    # For a quick smoke run (tests): 2 layers x 32 experts, 128 x 64 -> 13.8 KB records.
    "smoke": {"hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
              "num_hidden_layers": 2, "full_attention_interval": 2, "num_experts": 32,
              "num_experts_per_tok": 4, "mtp_num_hidden_layers": 0},
}


def log(msg: str) -> None:
    print(f"[bench_stream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the model


def make_model(work: Path, shape: str, bits: int, group_size: int) -> Path:
    """The qnpipe directory `work/<shape>-<bits>b-g<group>` (made once: HF random -> convert)."""
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    out = work / f"{shape}-{bits}b-g{group_size}"
    if (out / "config.json").exists():
        log(f"reusing {out}")
        return out
    work.mkdir(parents=True, exist_ok=True)
    hf = work / f".{shape}-hf"
    t0 = time.perf_counter()
    log(f"making the HF model {hf} ({shape})")
    make_tiny(hf, layout="hf", seed=0, config_overrides=SHAPES[shape], force=True)
    log(f"converting to {out} ({bits} bits, group {group_size}) after {time.perf_counter() - t0:.0f} s")
    convert(hf, out, bits=bits, group_size=group_size, force=True)
    shutil.rmtree(hf, ignore_errors=True)
    log(f"model ready in {time.perf_counter() - t0:.0f} s")
    return out


# ---------------------------------------------------------------------------- instruments


class Instruments:
    """Timers wrapped around one engine's backend (both sides of the MLX-thread hand-off) and reader."""

    def __init__(self, eng: Any) -> None:
        rt = eng._eng._rt  # the engine's runtime: pipeline, core (internals; read-only use + wrappers)
        self.rt = rt
        self.mlx_s = 0.0  # inside MlxBackend.begin/resume, on the MLX thread
        self.mlx_cpu_s = 0.0  # ... the MLX thread's CPU time in them
        self.await_s = 0.0  # awaiting ThreadedBackend.begin/resume, on the trio thread
        self.reads: list[tuple[float, float]] = []  # SsdReader.read_batch / start..done intervals
        # ... each started batch from the hand-over call's return, even when a read began before it (`overhead_frac_handover`)
        self.reads_handover: list[tuple[float, float]] = []
        # The started batches' intervals from when a reader thread took their first read (`PendingRead.t_started`),
        # and the delay to it from their start.
        self.reads_taken: list[tuple[float, float]] = []
        self.take_delays: list[float] = []
        self.calls: list[tuple[float, float]] = []  # MlxBackend.begin/resume intervals (the MLX thread)
        fwd = rt.pipe.forward
        mlxb = fwd.backend._b
        for name in ("begin", "resume"):
            setattr(mlxb, name, self._timed_mlx(getattr(mlxb, name)))
        fwd.backend = self.timed = _TimedBackend(fwd.backend, self)
        self._fwd = fwd
        st = rt.core.streaming
        if st is not None:
            reader = st.reader
            inner = reader.read_batch

            def read_batch(reqs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return inner(reqs)
                finally:
                    self.reads.append((t0, time.perf_counter()))
                    self.reads_handover.append(self.reads[-1])

            reader.read_batch = read_batch  # StoreDevice calls self._reader.read_batch (or start, below)
            if getattr(reader, "starts", False):
                def started(start: Any) -> Any:
                    def wrapped(*args: Any) -> Any:
                        pending = start(*args)
                        for name in ("poll", "poll_nbytes"):  # the live device calls the second
                            setattr(pending, name, polled(pending, getattr(pending, name)))
                        return pending

                    return wrapped

                def polled(pending: Any, poll: Any) -> Any:
                    def timed() -> Any:  # from the batch's start to when the device finished its last read
                        out = poll()
                        if out is not None:
                            # On the device from the hand-over, or from its first read when a reader thread took
                            # it before the hand-over call returned (the woken reader ran first on the loop's CPU).
                            self.reads.append((min(pending.t_start, pending.t_started), pending.t_done))
                            self.reads_handover.append((pending.t_start, pending.t_done))
                            self.reads_taken.append((pending.t_started, pending.t_done))
                            self.take_delays.append(pending.t_started - pending.t_start)
                        return out

                    return timed

                reader.start = started(reader.start)  # `start_at` plans nothing per read, `start` every read
                if hasattr(reader, "start_at"):
                    reader.start_at = started(reader.start_at)

    @property
    def hits_cpu_s(self) -> float:
        """The CPU of the forward's turns for hits, inside the MLX calls (`patch_item`'s timers)."""
        return HITS_CPU_S.get(id(self._fwd), 0.0)

    def _timed_mlx(self, fn: Any) -> Any:
        def wrapped(*a: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a)
            finally:
                t1 = time.perf_counter()
                self.mlx_s += t1 - t0
                self.mlx_cpu_s += time.thread_time() - c0
                self.calls.append((t0, t1))
        return wrapped

    def device_union(self, since: float) -> float:
        """Wall time during which at least one read batch ran, after `since`."""
        return union_s(self.reads, since)

    def busy_union(self, since: float) -> float:
        """Wall time after `since` inside an MLX call, the token read, or a read batch (any of them)."""
        return union_s(self.reads + self.calls + ITEM_IV, since)

    def busy_union_handover(self, since: float) -> float:
        """`busy_union` with each started batch from the hand-over call's return only."""
        return union_s(self.reads_handover + self.calls + ITEM_IV, since)

    def busy_union_taken(self, since: float) -> float:
        """`busy_union` with each started batch from its first read's take, not its start (read_batch's alike)."""
        return union_s((self.reads_taken or self.reads) + self.calls + ITEM_IV, since)


def union_s(intervals: list[tuple[float, float]], since: float) -> float:
    """Length of the union of `intervals` that start at or after `since`."""
    total, end = 0.0, since
    for a, b in sorted(iv for iv in intervals if iv[0] >= since):
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


class _TimedBackend:
    def __init__(self, inner: Any, inst: Instruments) -> None:
        self._inner = inner
        self._inst = inst
        self.hits = True  # False: hits wait for their turn, the token is read first (the `allhit_turn` engine)

    @property
    def takes_hits(self) -> bool:
        return self.hits and getattr(self._inner, "takes_hits", False)

    async def begin(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await self._inner.begin(*a, **kw)
        finally:
            self._inst.await_s += time.perf_counter() - t0

    async def resume(self, *a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await self._inner.resume(*a)
        finally:
            self._inst.await_s += time.perf_counter() - t0

    async def abort(self) -> None:
        await self._inner.abort()


def loop_cpu_s(eng: Any) -> float:
    """CPU time of the thread whose trio loop runs `eng`'s pipeline (the MLX thread's own loop, or
    with prefetch on a thread of the engine's own: qnpipe.engine.Engine)."""
    ident = eng.loop_thread.ident
    assert ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


ITEM_S = [0.0]  # time in decoding._item (reading the sampled token: waits for the LM head), MLX thread
ITEM_CPU_S = [0.0]  # ... its CPU time
ITEM_IV: list[tuple[float, float]] = []  # ... its intervals


def patch_item() -> None:
    from qnpipe.live import decoding

    inner = decoding._item

    def _item(y: Any) -> int:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(y)
        finally:
            t1 = time.perf_counter()
            ITEM_S[0] += t1 - t0
            ITEM_IV.append((t0, t1))
            ITEM_CPU_S[0] += time.thread_time() - c0

    decoding._item = _item  # looked up as a global at each call

    from qnpipe.live.session import DecodeSession

    commit = DecodeSession.commit

    def timed_commit(self: Any, tokens: Any, now: float) -> bool:
        COMMITS.append((time.perf_counter(), len(tokens)))
        return commit(self, tokens, now)

    DecodeSession.commit = timed_commit  # pyright: ignore[reportAttributeAccessIssue]

    # The pipeline's own work, though it runs inside an MLX call (qnpipe.actors.forward, hits before their turn).
    from qnpipe.actors.forward import Forward

    for name in ("hit_slots", "hit_queued"):
        inner_hit = getattr(Forward, name)

        def timed_hit(self: Any, *a: Any, _inner: Any = inner_hit) -> Any:
            c0 = time.thread_time()
            try:
                return _inner(self, *a)
            finally:
                HITS_CPU_S[id(self)] = HITS_CPU_S.get(id(self), 0.0) + time.thread_time() - c0

        setattr(Forward, name, timed_hit)


HITS_CPU_S: dict[int, float] = {}  # id(Forward) -> CPU s in its hit_slots / hit_queued


COMMITS: list[tuple[float, int]] = []  # (when, tokens) of each DecodeSession.commit of the current call


def steady_tok_s(commits: list[tuple[float, int]]) -> float:
    """Decode tok/s from the first commit to the next-to-last: the tokens committed after the first, up to and
    including the next-to-last commit, over that time. On MLX's CPU backend the resident engine reads its first
    token only once the step queued behind it is done too, and its last one at once after the one before, so
    `decode_tok_s` (first to last) counts n - 1 tokens over n - 2 steps there; this counts every engine alike.
    0.0 with fewer than 3 commits."""
    if len(commits) < 3:
        return 0.0
    span = commits[-2][0] - commits[0][0]
    return sum(n for _, n in commits[1:-1]) / span if span > 0 else 0.0


def round_prompt(r: int, vocab_size: int) -> list[int]:
    """Round `r`'s one-token prompt: 10 + 37 r, wrapped to stay inside the vocabulary."""
    return [10 + (37 * r) % (vocab_size - 10)]


def _no_tail(h: Any) -> None:
    """The fake backend's steps end in nothing."""


def pool_figures(eng: Any) -> dict[str, float]:
    p = eng.stats().pool
    if p is None:
        return {}
    return {"hits": p.hits, "misses": p.misses, "cold": p.misses_by_cause.get("cold", 0),
            "capacity": p.misses_by_cause.get("capacity", 0), "reads": p.reads, "bytes_read": p.bytes_read,
            "stall_s": p.stall_s, "device_s": p.device_s, "steps": p.steps, "layer_steps": p.layer_steps,
            "split_layer_steps": p.split_layer_steps, "peak_reads_in_flight": p.peak_reads_in_flight}


def run_call(eng: Any, inst: Instruments, prompt: list[int], n: int, seed: int) -> dict[str, float]:
    """One generate call and its per-step figures."""
    p0 = pool_figures(eng)
    rs = inst.rt.pipe.read_stats
    b0 = rs.batches if rs is not None else 0
    m0, a0, i0 = inst.mlx_s, inst.await_s, ITEM_S[0]
    l0, mc0, ic0, hc0 = loop_cpu_s(eng), inst.mlx_cpu_s, ITEM_CPU_S[0], inst.hits_cpu_s
    COMMITS.clear()
    k0 = len(inst.take_delays)
    t0 = time.perf_counter()
    res = eng.generate(prompt, max_tokens=n, temperature=1.0, seed=seed, stop_at_eos=False)
    wall = time.perf_counter() - t0
    tok_s = steady_tok_s(COMMITS) or res.stats.decode_tok_s
    p1 = pool_figures(eng)
    d = {k: p1[k] - p0[k] for k in p1}
    steps = d.get("steps") or res.stats.generated_tokens  # resident: one forward step per token
    mlx = inst.mlx_s - m0
    item = ITEM_S[0] - i0
    awaited = inst.await_s - a0
    loop = loop_cpu_s(eng) - l0
    from qnpipe.live.mlx_thread import MLXThread

    if eng.loop_thread is MLXThread.shared().thread:  # MLX calls run inline on that thread
        loop -= (inst.mlx_cpu_s - mc0) - (inst.hits_cpu_s - hc0) + (ITEM_CPU_S[0] - ic0)
    device = inst.device_union(t0)
    busy = inst.busy_union(t0)
    busy_taken = inst.busy_union_taken(t0)
    busy_handover = inst.busy_union_handover(t0)
    delays = inst.take_delays[k0:]
    out = {
        "tok_s": tok_s,
        "step_s": 1.0 / tok_s if tok_s else math.inf,
        "decode_tok_s": res.stats.decode_tok_s,
        "steps": steps,
        "wall": wall / steps,
        "mlx": (mlx + item) / steps,
        "hop": (awaited - mlx) / steps,
        "device": device / steps,
        "overhead": (wall - busy) / steps,
        "overhead_taken": (wall - busy_taken) / steps,
        "overhead_handover": (wall - busy_handover) / steps,
        "take_delay_us": statistics.median(delays) * 1e6 if delays else 0.0,
        "overhead_sum": (wall - mlx - item - device) / steps,
        "loop_work": loop / steps,
        "tokens": res.tokens,
    }
    if d:
        acc = d["hits"] + d["misses"]
        out |= {"misses": d["misses"] / steps, "bytes": d["bytes_read"] / steps, "reads": d["reads"] / steps,
                "stall": d["stall_s"] / steps, "hit_rate": d["hits"] / acc if acc else 0.0,
                "misses_per_layer_step": d["misses"] / d["layer_steps"] if d["layer_steps"] else 0.0,
                "layer_steps": d["layer_steps"] / steps,
                "capacity_misses": d["capacity"] / steps, "cold_misses": d["cold"] / steps,
                "split_layer_steps": d["split_layer_steps"],
                "read_batches": (rs.batches - b0) / steps if rs is not None else 0.0}
    return out


# ---------------------------------------------------------------------------- the pipeline alone


class _FakeBackend:
    """Answers at once: the next layer's route (uniform random top-k), StepDone after the last."""

    def __init__(self, layers: int, experts: int, k: int, seed: int, gap_s: float = 0.0) -> None:
        from qnpipe.steps import LayerRoute, StepDone

        self._route, self._done = LayerRoute, StepDone
        self.layers, self.experts, self.k = layers, experts, k
        self.rng = np.random.default_rng(seed)
        self.i = 0
        self.gap_s = gap_s  # the layer's compute, as an idle wait (the loop thread waits for MLX)

    def route(self) -> Any:
        return self._route(self.i, self.rng.choice(self.experts, self.k, replace=False).reshape(1, self.k))

    async def begin(self, inputs: Any, cache: Any, tail: Any) -> Any:
        self.i = 0
        return self.route()

    async def resume(self, grant: Any) -> Any:
        if self.gap_s:
            await trio.sleep(self.gap_s)
        self.i += 1
        return self._done(None) if self.i == self.layers else self.route()

    async def abort(self) -> None:
        pass


class _FakeDevice:
    """Completes every read at once; `hop`: through `trio.to_thread` first, as StoreDevice does."""

    def __init__(self, nbytes: int, hop: bool) -> None:
        self.nbytes, self.hop = nbytes, hop

    async def read(self, jobs: Any) -> list[int]:
        if self.hop:
            await trio.to_thread.run_sync(lambda: None)
        else:
            await trio.lowlevel.checkpoint()
        return [self.nbytes] * len(jobs)

    def statistics(self) -> None:
        return None


def bench_pipeline(layers: int, experts: int, k: int, capacity: int, nbytes: int, workers: int, *, hop: bool,
                   steps: int = 200, gap_s: float = 0.0) -> dict[str, float]:
    """The forward + pool + read-scheduler actors (qnpipe.actors.pipeline.open_pipeline) with no model and no
    disk: their own time per layer-step (wall beyond `gap_s`, and process CPU), after `steps // 4`
    warm-up steps. `gap_s`: each layer's compute as an idle wait, so the actors run in bursts."""
    from qnpipe import config as config_mod
    from qnpipe.actors.pipeline import open_pipeline

    cfg = config_mod.with_overrides(config_mod.Config(), {"read.workers": workers})

    async def run() -> dict[str, float]:
        be = _FakeBackend(layers, experts, k, seed=0, gap_s=gap_s)
        caps = dict.fromkeys(range(layers), capacity)
        async with open_pipeline(cfg, be, num_experts=experts, capacities=caps, device=_FakeDevice(nbytes, hop),
                                 record_nbytes=dict.fromkeys(range(layers), nbytes)) as p:
            assert p.read_stats is not None
            for _ in range(steps // 4):
                await p.forward.run(None, None, _no_tail)
            r0 = p.read_stats.reads
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                await p.forward.run(None, None, _no_tail)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = steps * layers
            return {"wall_us": (wall / n - gap_s) * 1e6, "cpu_us": cpu / n * 1e6,
                    "misses": (p.read_stats.reads - r0) / n}

    return trio.run(run)


def bench_floor(gap_s: float, steps: int = 200) -> dict[str, float]:
    """The messages of one demand layer-step and nothing else: forward -> pool (Acquire), pool ->
    scheduler (the reads), scheduler -> a thread -> scheduler (the batch, as the live device's
    submitter), scheduler -> pool (done), pool -> forward (Present, Granted), forward -> pool
    (Release), on trio channels with no bookkeeping; each layer-step after a `gap_s` idle wait.
    The trio thread's wall beyond the gap and CPU per layer-step: the fixed design's floor."""
    import queue
    import threading

    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def worker() -> None:
        while (item := jobs.get()) is not None:
            item[0].run_sync_soon(item[1].set)

    th = threading.Thread(target=worker, daemon=True)
    th.start()

    async def main() -> dict[str, float]:
        to_pool, pool_in = trio.open_memory_channel[str](16)
        to_sched, sched_in = trio.open_memory_channel[str](16)
        to_fwd, fwd_in = trio.open_memory_channel[str](16)

        async def pool() -> None:
            async for m in pool_in:
                if m == "acquire":
                    to_sched.send_nowait("reads")
                    to_fwd.send_nowait("present")
                elif m == "done":
                    to_fwd.send_nowait("granted")

        async def batch(ev: trio.Event) -> None:
            await ev.wait()
            to_pool.send_nowait("done")

        async def sched(nursery: trio.Nursery) -> None:
            async for _ in sched_in:
                ev = trio.Event()
                jobs.put((trio.lowlevel.current_trio_token(), ev))
                nursery.start_soon(batch, ev)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool)
            nursery.start_soon(sched, nursery)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                if gap_s:
                    await trio.sleep(gap_s)
                to_pool.send_nowait("acquire")
                await fwd_in.receive()  # Present
                await trio.lowlevel.checkpoint()
                await fwd_in.receive()  # Granted
                to_pool.send_nowait("release")
                await trio.lowlevel.checkpoint()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            nursery.cancel_scope.cancel()
        return {"wall_us": (wall / steps - gap_s) * 1e6, "cpu_us": cpu / steps * 1e6}

    try:
        return trio.run(main)
    finally:
        jobs.put(None)
        th.join()


# ---------------------------------------------------------------------------- bandwidth


def bench_bandwidth(model_dir: Path, qd: int, seconds: float, seed: int, *, nocache: bool = True,
                    backend: str = "c", submitters: int = 2) -> dict[str, Any]:
    """Cold random reads of the store's records, `qd` workers, fresh (layer, expert) draws per batch."""
    from qnpipe.io.measure import run_submitters
    from qnpipe.io.reader import ReadRequest, alloc_aligned
    from qnpipe.io.ssd import SsdReader
    from qnpipe.io.store import ExpertStore

    with ExpertStore.open(model_dir) as store:
        layers = list(store.layers)
        locs = {(la, e): store.record_location(la, e) for la in layers for e in range(store.layer_file(la).num_experts)}
    keys = list(locs)
    batch = max(32, 4 * qd)
    counts = [0] * submitters
    nbytes = [0] * submitters

    def make_batch(k: int) -> Callable[[], None]:
        rng = np.random.default_rng(seed * 1000 + k)
        bufs = [alloc_aligned(max(n for _, _, n in locs.values())) for _ in range(batch)]

        def one() -> None:
            picks = rng.integers(0, len(keys), batch).tolist()
            reqs = []
            for i, b in zip(picks, bufs, strict=True):
                path, off, n = locs[keys[i]]
                reqs.append(ReadRequest(path=str(path), offset=off, nbytes=n, buf=b, layer=keys[i][0], expert=keys[i][1]))
            reader.read_batch(reqs)
            counts[k] += batch
            nbytes[k] += sum(r.nbytes for r in reqs)
        return one

    with SsdReader(workers=qd, nocache=nocache, backend=backend) as reader:
        warm = alloc_aligned(max(n for _, _, n in locs.values()))
        reader.read_batch([ReadRequest(path=str(locs[(la, 0)][0]), offset=0, nbytes=locs[(la, 0)][2], buf=warm)
                           for la in layers])  # open the files
        dt = run_submitters(submitters, seconds, make_batch)
        rs = reader.statistics()
    return {"gbps": sum(nbytes) / dt / 1e9, "iops": sum(counts) / dt, "mode": str(rs.mode),
            "bounced": rs.bounced_reads, "fallbacks": rs.direct_fallbacks}


# ---------------------------------------------------------------------------- main


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def rnd(x: float, n: int = 4) -> float:
    return round(float(x), n) if math.isfinite(x) else x


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a qnpipe model directory (default: make / reuse one under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"),
                    help="where the made model is cached (default /tmp/qnpipe-bench-stream)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--pool-frac", type=float, default=0.25, help="demand pool capacity / experts per layer")
    ap.add_argument("--workers", type=int, default=16, help="read.workers (reads in flight)")
    ap.add_argument("--backend", default="c", help="read.backend (default c)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per generate call (default 16)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup-prompt", type=int, default=128,
                    help="prompt tokens of the warm-up prefill that fills the all-hit pool (default 128)")
    ap.add_argument("--bw-seconds", type=float, default=1.5)
    ap.add_argument("--no-allhit", action="store_true", help="skip the all-hit engines")
    ap.add_argument("--no-channel", action="store_true",
                    help="skip the all-hit engine whose hits go by channel (the path before inline hits)")
    ap.add_argument("--turn-ab", action="store_true",
                    help="also the all-hit engine whose hits are answered after the backend yields, the token read "
                         "first (the path before hits ran before their turn): the `_turn` keys")
    ap.add_argument("--allhit-only", action="store_true",
                    help="only resident and the all-hit engines: the pipeline's cost per layer-step (with --shape ms1: "
                         "ratio_allhit_to_resident_1ms)")
    ap.add_argument("--spec-ab", action="store_true",
                    help="also the all-hit pool with forward.speculate_hits on, in the same rounds "
                         "(ratio_allhit_spec_to_allhit)")
    ap.add_argument("--no-prefetch", action="store_true", help="skip the prefetch engine")
    ap.add_argument("--miss-ab", action="store_true",
                    help="also the demand engine with the miss path before 2026-12-05 (the `_before` keys; the "
                         "switches of --c-acquire-ab, --yield-ab, --own-reads-ab, --landed-ab, --reads-first-ab, "
                         "--foresee-ab and --submit-first-ab off too)")
    for flag, (what, keys) in {
        "--acquire-ab": ("whose acquires with misses go by channel", "_acquire_channel"),
        "--route-ab": ("that gives the other tasks their turn before a route's acquire", "_route_later"),
        "--targets-ab": ("whose device builds a request and a plan per read", "_targets_off"),
        "--c-acquire-ab": ("with the slot tables' Python acquire in place of the C one", "_python_acquire"),
        "--yield-ab": ("whose loop does not yield its CPU after handing a batch to the reader's threads",
                       "_no_yield"),
        "--own-reads-ab": ("whose demand batches are waited for by the read scheduler's task, not the forward's",
                           "_others_wait"),
        "--landed-ab": ("whose grants are taken before the backend runs them, not in its call", "_grant_first"),
        "--reads-first-ab": ("whose acquires put their reads on the device after the pool's whole turn",
                             "_reads_after_turn"),
        "--foresee-ab": ("whose grants run before their turn are foreseen once their reads are done",
                         "_foresee_late"),
        "--submit-first-ab": ("whose demand batches known before the read scheduler's turn go on the device in it",
                              "_submit_after_turn"),
    }.items():
        ap.add_argument(flag, action="store_true", help=f"also the demand engine {what} (the `{keys}` keys)")
    ap.add_argument("--prefetch-set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config field of the prefetch run, e.g. predict.stage_global_budget_experts=0")
    ap.add_argument("--side", type=int, default=16, help="pool.side_region_slots of the prefetch run (default 16)")
    ap.add_argument("--width", type=int, default=12, help="predict.width_experts of the prefetch run (default 12)")
    ap.add_argument("--per-layer-budget", type=int, default=12,
                    help="predict.per_layer_budget_experts of the prefetch run (default 12)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="write cProfile stats of the demand run (with --allhit-only: the all-hit run) (engine loop thread "
                         "and MLX thread) under this prefix")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    import qnpipe

    # The CPU BLAS is chosen when the engine is first reached (qnpipe.__getattr__), before anything imports
    # MLX: `patch_item` below imports the decode loop, which would leave MLX on its bundled BLAS.
    _ = qnpipe.Engine
    load0 = os.getloadavg()
    from qnpipe.io.store import ExpertStore

    model_dir = args.model or make_model(args.work, args.shape, args.bits, args.group_size)
    with ExpertStore.open(model_dir) as store:
        layers = list(store.layers)
        lf0 = store.layer_file(layers[0])
        num_experts = lf0.num_experts
        record_nbytes = lf0.record_nbytes
        stride = lf0.stride
        store_bytes = sum(store.layer_file(la).num_experts * store.layer_file(la).record_nbytes for la in layers)
    slots = max(1, round(num_experts * args.pool_frac))
    patch_item()
    # Autopin off everywhere: its heat file would make each run start from the previous one's pins.
    read = {"read.workers": args.workers, "read.nocache": True, "read.backend": args.backend, "pool.autopin": False}
    log(f"model {model_dir}: {len(layers)} MoE layers x {num_experts} experts, record {record_nbytes} B "
        f"(stride {stride}), store {store_bytes / 1e6:.0f} MB; demand pool {slots} slots/layer")

    engines: dict[str, Any] = {}
    engines["resident"] = qnpipe.Engine(model_dir, eager_load=True, prefill_chunk_tokens=0)
    if not args.allhit_only:
        engines["demand"] = qnpipe.Engine(model_dir, expert_slots=slots, prefill_chunk_tokens=0, **read)
        if args.miss_ab:  # the same demand pool with the miss path as before (qnpipe.io.device, actors.pipeline)
            from qnpipe.actors import forward as _forward
            from qnpipe.actors import pipeline as _pipeline
            from qnpipe.io import device as _device

            flags = ((_device, "_start_reads"), (_pipeline, "_inline_reads"), (_forward, "_reads_first"),
                     (_forward, "_route_turn_first"))
            for mod, name in flags:
                setattr(mod, name, False)  # read when the engine's pipeline opens
            try:
                engines["demand_before"] = qnpipe.Engine(model_dir, expert_slots=slots, prefill_chunk_tokens=0, **read)
            finally:
                for mod, name in flags:
                    setattr(mod, name, True)
        for name, (mod, flag) in DEMAND_VARIANTS.items():  # `--acquire-ab`, `--route-ab`: one switch off each
            if getattr(args, name.split("_", 1)[0] + "_ab"):
                module = importlib.import_module(mod)
                setattr(module, flag, False)  # read when the engine's pipeline opens
                try:
                    engines[f"demand_{name}"] = qnpipe.Engine(model_dir, expert_slots=slots, prefill_chunk_tokens=0,
                                                              **read)
                finally:
                    setattr(module, flag, True)
        for on, name in ((args.c_acquire_ab, "python_acquire"), (args.yield_ab, "no_yield"),
                         (args.own_reads_ab, "others_wait"), (args.landed_ab, "grant_first"),
                         (args.reads_first_ab, "reads_after_turn"), (args.foresee_ab, "foresee_late"),
                         (args.submit_first_ab, "submit_after_turn")):
            if on:  # its switch is read per call: set around its runs (`CALL_VARIANTS`)
                engines[f"demand_{name}"] = qnpipe.Engine(model_dir, expert_slots=slots, prefill_chunk_tokens=0,
                                                          **read)
    if not args.no_allhit or args.allhit_only:
        engines["allhit"] = qnpipe.Engine(model_dir, expert_slots=num_experts, prefill_chunk_tokens=0, **read)
        if not args.no_channel:
            from qnpipe.actors import pipeline as _pipeline

            _pipeline._inline_hits = False  # read when the engine's pipeline opens  # pyright: ignore[reportPrivateUsage]
            try:
                engines["allhit_channel"] = qnpipe.Engine(model_dir, expert_slots=num_experts,
                                                          prefill_chunk_tokens=0, **read)
            finally:
                _pipeline._inline_hits = True  # pyright: ignore[reportPrivateUsage]
        if args.turn_ab:  # its backend is told to take no hits (Instruments)
            engines["allhit_turn"] = qnpipe.Engine(model_dir, expert_slots=num_experts, prefill_chunk_tokens=0, **read)
        if args.spec_ab:  # the same all-hit pool with speculated hits (forward.speculate_hits), same rounds
            engines["allhit_spec"] = qnpipe.Engine(model_dir, expert_slots=num_experts, prefill_chunk_tokens=0,
                                                   **{**read, "forward.speculate_hits": True})
    if args.allhit_only:
        try:
            return _allhit_only(args, engines, model_dir, len(layers), load0)
        finally:
            for e in engines.values():
                e.close()
    if not args.no_prefetch:
        # The demand run's pool plus a side region that prefetches land in.
        engines["prefetch"] = qnpipe.Engine(
            model_dir, expert_slots=slots, prefill_chunk_tokens=0, **read,
            **{"predict.cross_layer_prefetch": True, "pool.side_region_slots": args.side,
               "predict.width_experts": args.width, "predict.per_layer_budget_experts": args.per_layer_budget,
               **dict(kv.split("=", 1) for kv in args.prefetch_set)})
    try:
        margs = engines["resident"].args
        k = margs.num_experts_per_tok
        inst = {name: Instruments(e) for name, e in engines.items()}
        if "allhit_turn" in inst:
            inst["allhit_turn"].timed.hits = False
        rng = np.random.default_rng(7)
        warm = rng.integers(3, 1000, args.warmup_prompt).tolist()
        for name, e in engines.items():
            t0 = time.perf_counter()
            # The all-hit pool is filled by one long prefill (k x prompt picks per layer); the
            # others only need their code paths warm.
            e.generate(warm if name.startswith("allhit") else warm[:4], max_tokens=8, temperature=1.0, seed=1,
                       stop_at_eos=False)
            log(f"warm-up {name}: {time.perf_counter() - t0:.1f} s")
        if "allhit" in engines:
            allhit_pool = engines["allhit"].stats().pool
            assert allhit_pool is not None
            occ = [la.occupancy for la in allhit_pool.layers]
            log(f"all-hit pool occupancy after warm-up: min {min(occ)} of {num_experts}")
        # The depth the demand run really keeps in flight: its misses per layer-step.
        probe = run_call(engines["demand"], inst["demand"], [3], args.tokens, seed=2)
        qd_eff = max(1, min(args.workers, math.ceil(probe["misses_per_layer_step"])))
        log(f"demand probe: {probe['tok_s']:.2f} tok/s, {probe['misses']:.1f} misses/token, "
            f"{probe['misses_per_layer_step']:.2f} per layer-step -> effective qd {qd_eff}")

        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        bw: list[dict[str, float]] = []
        bw_eff: list[dict[str, float]] = []
        prof = None
        if args.profile:
            import cProfile
            prof = (cProfile.Profile(), cProfile.Profile())
        for r in range(args.rounds):
            prompt = round_prompt(r, margs.vocab_size)
            seed = 100 + r
            toks = {}
            order = list(engines) if r % 2 == 0 else list(reversed(engines))  # ABC, CBA, ...: drift hits all alike
            for name in order:
                e = engines[name]
                if prof is not None and name == "demand":
                    _profile(e, prof, True)
                with call_variant(name):
                    res = run_call(e, inst[name], prompt, args.tokens, seed)
                if prof is not None and name == "demand":
                    _profile(e, prof, False)
                toks[name] = res.pop("tokens")
                runs[name].append(res)
            bw.append(bench_bandwidth(model_dir, args.workers, args.bw_seconds, seed=r, backend=args.backend))
            bw_eff.append(bench_bandwidth(model_dir, qd_eff, args.bw_seconds, seed=r + 50, backend=args.backend))
            same = all(t == toks["resident"] for t in toks.values())
            log(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {runs[n][-1]['tok_s']:.2f} tok/s" for n in runs)
                + f"  bw {bw[-1]['gbps']:.3f} GB/s @qd{args.workers}, {bw_eff[-1]['gbps']:.3f} @qd{qd_eff}"
                + ("" if same else "  (tokens differ between engines!)"))
        if prof is not None:
            _dump_profiles(prof, args.profile)
        # The actors alone (same shape, uniform random routes), while the engines idle.
        pipe = {}
        # demand_bursts: each layer-step's compute as a 5 ms idle wait, as in a decode, where the
        # loop thread waits for MLX and the disk between bursts of actor work.
        for name, cap, hop, gap, steps in (("allhit", num_experts, False, 0.0, 200), ("demand", slots, False, 0.0, 200),
                                           ("demand_to_thread", slots, True, 0.0, 200),
                                           ("demand_bursts", slots, False, 5e-3, 40)):
            pipe[name] = min((bench_pipeline(len(layers), num_experts, k, cap, record_nbytes, args.workers, hop=hop,
                                             steps=steps, gap_s=gap)
                              for _ in range(3)), key=lambda x: x["cpu_us"])
            log(f"pipeline alone, {name}: {pipe[name]['wall_us']:.0f} us wall, {pipe[name]['cpu_us']:.0f} us cpu "
                f"per layer-step ({pipe[name]['misses']:.2f} misses)")
        floor = {name: min((bench_floor(gap, steps) for _ in range(3)), key=lambda x: x["cpu_us"])
                 for name, gap, steps in (("back_to_back", 0.0, 2000), ("bursts", 5e-3, 200))}
        log("messages alone (the design's floor): " + ", ".join(
            f"{n} {x['wall_us']:.0f} us wall, {x['cpu_us']:.0f} us cpu" for n, x in floor.items()) + " per layer-step")
        final_pool = engines["demand"].stats().pool
        final_pools = {name: e.stats().pool for name, e in engines.items()}
        assert final_pool is not None
    finally:
        for e in engines.values():
            e.close()

    def m(name: str, key: str) -> float:
        return med([x[key] for x in runs[name]])

    step_res = m("resident", "step_s")
    bw_bps = med([b["gbps"] for b in bw]) * 1e9
    # The bound per round (its own resident step, misses and bandwidth), then the median.
    bounds = [1.0 / (res["step_s"] + dem["bytes"] / (b["gbps"] * 1e9))
              for res, dem, b in zip(runs["resident"], runs["demand"], bw, strict=True)]
    ratios = [dem["tok_s"] / bd for dem, bd in zip(runs["demand"], bounds, strict=True)]
    ovh = [d["overhead"] / d["wall"] for d in runs["demand"]]
    # The same bound with the demand run's own compute (its `mlx` time) instead of the resident
    # step: insensitive to load drifting between the runs on a shared machine.
    own = [1.0 / (d["mlx"] + d["bytes"] / (b["gbps"] * 1e9)) for d, b in zip(runs["demand"], bw, strict=True)]
    own_ratio = [d["tok_s"] / o for d, o in zip(runs["demand"], own, strict=True)]
    prefetch_keys: dict[str, Any] = {}
    if "prefetch" in runs:
        # Perfect overlap of the prefetch run's own reads (demand + prefetch) with compute.
        obounds = [1.0 / max(res["step_s"], pf["bytes"] / (b["gbps"] * 1e9))
                   for res, pf, b in zip(runs["resident"], runs["prefetch"], bw, strict=True)]
        pf_pool = final_pools["prefetch"]
        prefetch_keys = {
            "tok_s_prefetch": rnd(m("prefetch", "tok_s"), 3),
            "tok_s_overlap_bound": rnd(med(obounds), 3),
            "ratio_prefetch_to_overlap_bound": rnd(med([pf["tok_s"] / ob for pf, ob in
                                                        zip(runs["prefetch"], obounds, strict=True)])),
            "ratio_prefetch_to_demand": rnd(med([pf["tok_s"] / d["tok_s"] for pf, d in
                                                 zip(runs["prefetch"], runs["demand"], strict=True)])),
            "prefetch_recall": rnd(pf_pool.prefetch_recall),
            "useful_prefetch_ratio": rnd(pf_pool.useful_prefetch_ratio),
            "misses_by_cause_prefetch": dict(pf_pool.misses_by_cause),
            "misses_per_token_prefetch": rnd(m("prefetch", "misses"), 2),
            "bytes_per_token_prefetch": round(m("prefetch", "bytes")),
            "side_hits_prefetch": pf_pool.side_hits, "prefetch_issued": pf_pool.prefetch_issued,
            "prefetch_expired": pf_pool.prefetch_expired, "wasted_bytes_prefetch": pf_pool.wasted_bytes,
            "hints_dropped_budget": pf_pool.hints_dropped_budget, "hints_dropped_full": pf_pool.hints_dropped_full,
            "overhead_frac_prefetch": rnd(med([p_["overhead"] / p_["wall"] for p_ in runs["prefetch"]])),
            "overhead_frac_loop_prefetch": rnd(med([p_["loop_work"] / p_["wall"] for p_ in runs["prefetch"]])),
            "prefetch_settings": {"side_region_slots": args.side, "width_experts": args.width,
                                  "per_layer_budget_experts": args.per_layer_budget,
                                  **dict(kv.split("=", 1) for kv in args.prefetch_set)},
        }
    out: dict[str, Any] = {
        "bench": "stream",
        "model": str(model_dir),
        "shape": {"moe_layers": len(layers), "num_experts": num_experts, "top_k": k,
                  "hidden_size": margs.hidden_size,
                  "moe_intermediate_size": margs.moe_intermediate_size,
                  "bits": args.bits if not args.model else None},
        "record_nbytes": record_nbytes, "record_stride": stride,
        "pool_slots_per_layer": slots, "pool_bytes": final_pool.slot_bytes, "store_bytes": store_bytes,
        "store_to_pool": rnd(store_bytes / final_pool.slot_bytes, 2),
        "reads_in_flight": args.workers, "read_backend": args.backend, "read_mode": bw[0]["mode"],
        "tokens_per_round": args.tokens, "rounds": args.rounds,
        **{f"decode_tok_s_{n}": rnd(m(n, "decode_tok_s"), 3) for n in runs},
        "tok_s_resident": rnd(m("resident", "tok_s"), 3),
        "tok_s_demand": rnd(m("demand", "tok_s"), 3),
        "tok_s_allhit": rnd(m("allhit", "tok_s"), 3) if "allhit" in runs else None,
        "tok_s_serial_bound": rnd(med(bounds), 3),
        "ratio_demand_to_serial_bound": rnd(med(ratios)),
        "tok_s_serial_bound_own_compute": rnd(med(own), 3),
        "ratio_demand_to_serial_bound_own_compute": rnd(med(own_ratio)),
        "misses_per_token": rnd(m("demand", "misses"), 2),
        "read_batches_per_token": rnd(m("demand", "read_batches"), 2),
        "missed_bytes_per_token": round(m("demand", "bytes")),
        "reads_per_token": rnd(m("demand", "reads"), 2),
        "misses_per_layer_step": rnd(m("demand", "misses_per_layer_step"), 3),
        "hit_rate_demand": rnd(m("demand", "hit_rate")),
        "bandwidth_gbps": rnd(bw_bps / 1e9),
        "bandwidth_iops": round(med([b["iops"] for b in bw])),
        "effective_qd": qd_eff,
        "bw_at_effective_qd_gbps": rnd(med([b["gbps"] for b in bw_eff])),
        "tok_s_serial_bound_at_effective_qd": rnd(
            1.0 / (step_res + m("demand", "bytes") / (med([b["gbps"] for b in bw_eff]) * 1e9)), 3),
        "overhead_frac": rnd(med(ovh)),
        # The same with each batch on the device from when a reader thread took its first read: the thread
        # hand-off's delay counted as the pipeline's too, and the batch's median delay.
        "overhead_frac_from_first_read": rnd(med([d["overhead_taken"] / d["wall"] for d in runs["demand"]])),
        "overhead_frac_handover": rnd(med([d["overhead_handover"] / d["wall"] for d in runs["demand"]])),
        "read_take_delay_us": rnd(med([d["take_delay_us"] for d in runs["demand"]]), 1),
        # The demand run's overhead (as overhead_frac's) per layer-step, in µs.
        "pipeline_us_per_layer_step_demand": rnd(med([d["overhead"] / d["layer_steps"] * 1e6
                                                      for d in runs["demand"]]), 1),
        "overhead_frac_sum": rnd(med([d["overhead_sum"] / d["wall"] for d in runs["demand"]])),
        "overhead_frac_loop": rnd(med([d["loop_work"] / d["wall"] for d in runs["demand"]])),
        "overhead_frac_loop_allhit": rnd(med([a["loop_work"] / a["wall"] for a in runs["allhit"]]))
        if "allhit" in runs else None,
        "overhead_frac_allhit": rnd(med([(a["step_s"] - r_["step_s"]) / a["step_s"]
                                         for a, r_ in zip(runs["allhit"], runs["resident"], strict=True)]))
        if "allhit" in runs else None,
        "overhead_frac_allhit_direct": rnd(med([a["overhead"] / a["wall"] for a in runs["allhit"]]))
        if "allhit" in runs else None,
        **allhit_keys(runs, len(layers)),
        "loadavg_start_end": [rnd(load0[0], 2), rnd(os.getloadavg()[0], 2)], "cpus": os.cpu_count(),
        "targets": {"ratio_demand_to_serial_bound": ">= 0.9", "overhead_frac": "< 0.05",
                    "ratio_prefetch_to_demand": "> 1", "ratio_prefetch_to_overlap_bound": ">= 0.85"},
        **prefetch_keys,
        "breakdown_ms_per_token": {
            name: {key: rnd(m(name, key) * 1e3, 3) for key in ("wall", "mlx", "hop", "device", "overhead", "overhead_sum", "loop_work")
                   + (("stall",) if name != "resident" else ())}
            for name in runs},
        "overhead_frac_alone": rnd(pipe["demand"]["cpu_us"] * 1e-6 * len(layers) / m("demand", "wall")),
        "overhead_frac_alone_bursts": rnd(pipe["demand_bursts"]["cpu_us"] * 1e-6 * len(layers) / m("demand", "wall")),
        "overhead_frac_floor_bursts": rnd(floor["bursts"]["cpu_us"] * 1e-6 * len(layers) / m("demand", "wall")),
        "floor_us_per_layer_step": {name: {key: rnd(v, 2) for key, v in x.items()} for name, x in floor.items()},
        "pipeline_alone_us_per_layer_step": {
            name: {key: rnd(v, 2) for key, v in x.items()} for name, x in pipe.items()},
        "allhit_misses_per_token": rnd(m("allhit", "misses"), 3) if "allhit" in runs else None,
        **({} if "demand_before" not in runs else {
            # The demand run with the miss path before 2026-12-05 (`--miss-ab`), same rounds.
            "tok_s_demand_before": rnd(m("demand_before", "tok_s"), 3),
            "ratio_demand_to_serial_bound_before": rnd(med([d["tok_s"] / bd for d, bd in
                                                            zip(runs["demand_before"], bounds, strict=True)])),
            "overhead_frac_before": rnd(med([d["overhead"] / d["wall"] for d in runs["demand_before"]])),
            "overhead_frac_loop_before": rnd(med([d["loop_work"] / d["wall"] for d in runs["demand_before"]])),
            "ratio_demand_to_demand_before": rnd(med([d["tok_s"] / t["tok_s"] for d, t in
                                                      zip(runs["demand"], runs["demand_before"], strict=True)])),
            "overhead_frac_raw": [rnd(x) for x in ovh],
            "overhead_frac_before_raw": [rnd(d["overhead"] / d["wall"]) for d in runs["demand_before"]]}),
        **{k: v for name in (*DEMAND_VARIANTS, *CALL_VARIANT_NAMES) if f"demand_{name}" in runs
           for k, v in variant_keys(name, runs["demand"], runs[f"demand_{name}"], ovh).items()},
        "step_s_raw": {name: [rnd(x["step_s"], 5) for x in runs[name]] for name in runs},
        "bandwidth_gbps_raw": [rnd(b["gbps"]) for b in bw],
        "bw_at_effective_qd_gbps_raw": [rnd(b["gbps"]) for b in bw_eff],
        "serial_bound_tok_s_raw": [rnd(b, 3) for b in bounds],
    }
    print(json.dumps(out), flush=True)
    return 0


# The demand engine with one switch of the miss path off, in the same rounds (`--acquire-ab`, `--route-ab`):
# name -> (module, flag). Its keys: `variant_keys`.
DEMAND_VARIANTS = {
    "acquire_channel": ("qnpipe.actors.pipeline", "_inline_acquires"),  # an acquire with misses sent by channel
    "route_later": ("qnpipe.actors.forward", "_route_turn_first"),  # the other tasks' turn before a route's acquire
    "targets_off": ("qnpipe.io.device", "_in_place"),  # a request and a plan built per read
}
# Likewise, for switches read at each call rather than when the engine opens: set off around the engine's runs.
# engine -> (module, flag). `demand_before` (`--miss-ab`) has the slot tables' Python acquire too.
_C_ACQUIRE = ("qnpipe.policy.slot_table", "_c_acquire")
_YIELD = ("qnpipe.io.pending", "_yield_after_start")
_OWN_READS = ("qnpipe.actors.forward", "_wait_own_reads")
_LANDED = ("qnpipe.actors.forward", "_landed_grants")
_READS_FIRST = ("qnpipe.actors.pool", "_reads_first")
_FORESEE = ("qnpipe.actors.forward", "_foresee_early")
_SUBMIT_FIRST = ("qnpipe.actors.read_scheduler", "_submit_first")
CALL_VARIANTS = {
    "demand_python_acquire": (_C_ACQUIRE,),  # `--c-acquire-ab`
    "demand_no_yield": (_YIELD,),  # `--yield-ab`
    "demand_others_wait": (_OWN_READS,),  # `--own-reads-ab`
    "demand_grant_first": (_LANDED,),  # `--landed-ab`
    "demand_reads_after_turn": (_READS_FIRST,),  # `--reads-first-ab`
    "demand_foresee_late": (_FORESEE,),  # `--foresee-ab`
    "demand_submit_after_turn": (_SUBMIT_FIRST,),  # `--submit-first-ab`
    "demand_before": (_C_ACQUIRE, _YIELD, _OWN_READS, _LANDED, _READS_FIRST, _FORESEE, _SUBMIT_FIRST),
}
CALL_VARIANT_NAMES = ("python_acquire", "no_yield", "others_wait", "grant_first", "reads_after_turn",
                      "foresee_late", "submit_after_turn")  # their keys' suffixes


@contextlib.contextmanager
def call_variant(engine: str) -> Iterator[None]:
    """`engine`'s switches of `CALL_VARIANTS` off for the block (nothing for the other engines)."""
    switches = [(importlib.import_module(mod), flag) for mod, flag in CALL_VARIANTS.get(engine, ())]
    saved = [getattr(module, flag) for module, flag in switches]
    for module, flag in switches:
        setattr(module, flag, False)
    try:
        yield
    finally:
        for (module, flag), value in zip(switches, saved, strict=True):
            setattr(module, flag, value)


def variant_keys(name: str, demand: list[dict[str, float]], variant: list[dict[str, float]],
                 ovh: list[float]) -> dict[str, Any]:
    """`tok_s_demand_<name>`, `overhead_frac_<name>`, `ratio_demand_to_demand_<name>` (tok/s, per round then the
    median), and the rounds' fractions both ways (`_raw`)."""
    return {
        f"tok_s_demand_{name}": rnd(med([d["tok_s"] for d in variant]), 3),
        f"overhead_frac_{name}": rnd(med([d["overhead"] / d["wall"] for d in variant])),
        f"ratio_demand_to_demand_{name}": rnd(med([d["tok_s"] / t["tok_s"]
                                                   for d, t in zip(demand, variant, strict=True)])),
        "overhead_frac_raw": [rnd(x) for x in ovh],
        f"overhead_frac_{name}_raw": [rnd(d["overhead"] / d["wall"]) for d in variant],
    }


def allhit_keys(runs: dict[str, list[dict[str, float]]], moe_layers: int) -> dict[str, Any]:
    """The all-hit pipeline's cost per MoE layer-step over resident (µs, from decode tok/s, per round then the
    median), the tok/s ratio, the loop thread's CPU per layer-step beyond resident's, and the same for the
    engine whose hits go by channel (the path before inline hits)."""
    out: dict[str, Any] = {}
    for name, suffix in (("allhit", ""), ("allhit_channel", "_channel"), ("allhit_turn", "_turn")):
        if name not in runs:
            continue
        pairs = list(zip(runs[name], runs["resident"], strict=True))
        out[f"pipeline_us_per_layer_step_allhit{suffix}"] = rnd(
            med([(a["step_s"] - r["step_s"]) / moe_layers * 1e6 for a, r in pairs]), 1)
        out[f"ratio_allhit{suffix}_to_resident"] = rnd(med([a["tok_s"] / r["tok_s"] for a, r in pairs]))
        # The loop thread's own CPU beyond resident's (MLX calls taken out): robust to a loaded machine.
        out[f"pipeline_cpu_us_per_layer_step_allhit{suffix}"] = rnd(
            med([(a["loop_work"] - r["loop_work"]) / moe_layers * 1e6 for a, r in pairs]), 1)
        out[f"pipeline_us_per_layer_step_allhit{suffix}_raw"] = [
            rnd((a["step_s"] - r["step_s"]) / moe_layers * 1e6, 1) for a, r in pairs]
    return out


def _allhit_only(args: argparse.Namespace, engines: dict[str, Any], model_dir: Path, moe_layers: int,
                 load0: tuple[float, float, float]) -> int:
    """Resident against the all-hit engines only, in interleaved rounds; one JSON line."""
    import os

    inst = {name: Instruments(e) for name, e in engines.items()}
    if "allhit_turn" in inst:
        inst["allhit_turn"].timed.hits = False
    rng = np.random.default_rng(7)
    warm = rng.integers(3, 1000, args.warmup_prompt).tolist()
    for name, e in engines.items():
        e.generate(warm if name.startswith("allhit") else warm[:4], max_tokens=8, temperature=1.0, seed=1,
                   stop_at_eos=False)
    vocab = engines["resident"].args.vocab_size
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    prof = None
    if args.profile:
        import cProfile
        prof = (cProfile.Profile(), cProfile.Profile())
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            if prof is not None and name == "allhit":
                _profile(engines[name], prof, True)
            res = run_call(engines[name], inst[name], round_prompt(r, vocab), args.tokens, 100 + r)
            if prof is not None and name == "allhit":
                _profile(engines[name], prof, False)
            res.pop("tokens")
            runs[name].append(res)
        log(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {runs[n][-1]['tok_s']:.2f} tok/s" for n in runs))
    if prof is not None:
        _dump_profiles(prof, args.profile, "allhit")
    keys = allhit_keys(runs, moe_layers)
    ms = med([x["step_s"] for x in runs["resident"]]) / moe_layers * 1e3
    if args.shape == "ms1" and not args.model:
        keys["ratio_allhit_to_resident_1ms"] = keys["ratio_allhit_to_resident"]
    out = {"bench": "stream_allhit", "model": str(model_dir), "shape": args.shape, "moe_layers": moe_layers,
           "tokens_per_round": args.tokens, "rounds": args.rounds,
           "resident_ms_per_layer_step": rnd(ms, 3),
           **{f"tok_s_{n}": rnd(med([x["tok_s"] for x in runs[n]]), 3) for n in runs},
           **{f"decode_tok_s_{n}": rnd(med([x["decode_tok_s"] for x in runs[n]]), 3) for n in runs}, **keys,
           "allhit_misses_per_token": rnd(med([x["misses"] for x in runs["allhit"]]), 3),
           **({"ratio_allhit_spec_to_allhit": rnd(
               med([a["tok_s"] / b["tok_s"] for a, b in zip(runs["allhit_spec"], runs["allhit"], strict=True)]), 4)}
              if "allhit_spec" in runs else {}),
           "loadavg_start_end": [rnd(load0[0], 2), rnd(os.getloadavg()[0], 2)], "cpus": os.cpu_count()}
    print(json.dumps(out), flush=True)
    return 0


def _profile(eng: Any, prof: tuple[Any, Any], on: bool) -> None:
    """Enable / disable `prof[0]` on the engine's trio thread and `prof[1]` on the MLX thread."""
    from qnpipe.live.mlx_thread import MLXThread

    async def toggle() -> None:
        prof[0].enable() if on else prof[0].disable()

    eng._call(toggle)
    if eng.loop_thread is not MLXThread.shared().thread:  # else one thread, one profiler: prof[0]
        MLXThread.shared().call(prof[1].enable if on else prof[1].disable)


def _dump_profiles(prof: tuple[Any, Any], prefix: Path, run: str = "demand") -> None:
    import io
    import pstats

    for p, which in zip(prof, ("trio", "mlx"), strict=True):
        if p.getstats() == []:  # the engine's loop runs on the MLX thread: one thread, one profiler
            continue
        path = Path(f"{prefix}.{which}.prof")
        p.dump_stats(path)
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(25)
        log(f"cProfile of the {which} thread ({run} run) -> {path}\n{s.getvalue()}")


def main_make_only(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"))
    ap.add_argument("--shape", default="bench")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args(argv)
    print(make_model(a.work, a.shape, a.bits, a.group_size))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        sys.exit(main_make_only(sys.argv[2:]))
    sys.exit(main())
