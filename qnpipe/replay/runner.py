"""Replay a routing or event log through the real pool and read scheduler, in virtual time.

    report = replay("run.qtrace", cfg, device_profile=PROFILES["apple-m5-internal"],
                    cost=CostModel(per_layer_s=2e-3, per_token_s=0.0))

The log's `trace.route` records drive a `LogBackend` (the forward's `Backend` seam) step by
step; each layer's compute is modelled (`await trio.sleep(cost)`), reads go to a `SimSSD`,
and the run happens under `MockClock(autojump_threshold=0)` (style §7.4): no model, no
MLX work, no threads, the same report on every run. The pool and read scheduler are the
live actors (`qnpipe.actors.pipeline.open_pipeline`), so hit rates and miss causes are the
policy's own. Each layer's Belady optimum (`qnpipe.replay.belady`) is reported beside it.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import trio
import trio.testing

from qnpipe.actors.pipeline import layer_capacities, open_pipeline
from qnpipe.actors.turns import Turnstile, exact_clock
from qnpipe.config import Config, with_overrides
from qnpipe.errors import ConfigError, QnpipeError, TraceSchemaError
from qnpipe.io.device_file import named_profile
from qnpipe.io.files import CONFIG_CAP, read_text_capped
from qnpipe.io.simssd import DeviceProfile, open_simssd
from qnpipe.messages import Candidates, ReadDone
from qnpipe.policy.build import check_placement, side_slots
from qnpipe.policy.parts import plan_parts_flat
from qnpipe.replay import caveats
from qnpipe.replay.belady import belady_hits
from qnpipe.replay.fast import FastReplay, RunResult
from qnpipe.replay.model_free import TransitionTable, oracle_guess, previous_guess
from qnpipe.steps import Event, LayerRoute, PartDone, PartGrant, StepDone, Tail
from qnpipe.trace import Header, ModelShape, Route, check_log_paths, read
from qnpipe.trace.logs import SyncLogs, wanted_logs

PREDICTORS = ("none", "previous", "recorded", "transition", "oracle")
# "fast": the cores on a plain event loop (qnpipe.replay.fast); "actors": the live trio actors on a
# virtual clock, the reference. The same report, byte for byte (tests/replay/test_drivers.py).
DRIVERS = ("fast", "actors")

# What a LogBackend hands the forward at one layer-step: (target, ids [N, W], scores [N, W]) per target.
Predictions = tuple[tuple[int, np.ndarray, np.ndarray], ...]


# Bounds of the replay's own settings: far beyond any real machine, far below what breaks the
# virtual clock's arithmetic (a 1e300 s layer would make every later time equal to it).
MAX_COST_S = 3600.0  # an hour for one layer part, one step's extra or one read batch's hop
MAX_TABLE_LAYERS = 10_000
MAX_RECORD_NBYTES = 1 << 40


def _check_seconds(key: str, v: float) -> None:
    if not (math.isfinite(v) and 0.0 <= v <= MAX_COST_S):
        raise ConfigError(f"{key}={v!r}: must be a finite number of seconds in [0, {MAX_COST_S:g}]")


def check_record_nbytes(n: int, key: str = "replay.record_nbytes") -> int:
    """`n`, or ConfigError naming `key` when it is not in [1, MAX_RECORD_NBYTES]."""
    if not 1 <= n <= MAX_RECORD_NBYTES:
        raise ConfigError(f"{key}={n}: must be in [1, {MAX_RECORD_NBYTES}] (bytes of one expert record)")
    return n


def setting_value(key: str, text: Any) -> Any:
    """A replay setting's value (`cost.*`, `device.*`, `replay.*`) of its field's type, from text (`--set`, a grid).

    ConfigError names the key and the value; the range is checked with the struct (`CostModel.check`, ...)."""
    section, _, name = key.partition(".")
    types: dict[str, Any] = {"replay.record_nbytes": int, "replay.predictor": str}
    for struct, prefix in ((CostModel, "cost"), (DeviceProfile, "device")):
        types |= {f"{prefix}.{f.name}": f.type for f in msgspec.structs.fields(struct)}
    if key not in types:
        raise ConfigError(f"{key}: not a replay setting (known: {', '.join(sorted(types))})")
    want = types[key]
    if want not in (int, float, str):
        raise ConfigError(f"{key}: cannot be set from text (a cost file sets it)")
    try:
        return msgspec.convert(text.strip() if isinstance(text, str) else text, want, strict=False)
    except msgspec.ValidationError:
        raise ConfigError(f"{section}.{name}={text}: expected {'an integer' if want is int else 'a number'}") from None


class CostModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Modelled compute: each MoE layer part takes `per_layer_s + per_token_s * tokens` (its layer's
    `layer_table` entry in place of `per_layer_s` when it has one), plus `per_miss_s` for each expert
    its grant had to read (the compute a miss costs beyond its wait: on a machine whose cores the
    reader's threads share, the forward's next work runs slower after a read), and each
    step `per_step_s` more before its first MoE layer (head, sampling, the decode loop); each
    read batch waits `read_hop_s` before it reaches the device. Fitted by `qnpipe.replay.cost_fit`."""

    per_layer_s: float = 2e-3
    per_token_s: float = 0.0
    per_step_s: float = 0.0
    read_hop_s: float = 0.0  # the live read path's time per read batch beyond the device (thread hand-offs)
    layer_table: dict[int, float] = msgspec.field(default_factory=dict)  # per_layer_s of the layers listed
    per_miss_s: float = 0.0  # compute per expert a part's grant read (after the wait, which the device models)

    def check(self, where: str = "cost.") -> CostModel:
        """Self, or ConfigError naming the bad term (`where` + its name) and its value."""
        for name in ("per_layer_s", "per_token_s", "per_step_s", "read_hop_s", "per_miss_s"):
            _check_seconds(f"{where}{name}", getattr(self, name))
        if len(self.layer_table) > MAX_TABLE_LAYERS:
            raise ConfigError(f"{where}layer_table: {len(self.layer_table)} entries: at most {MAX_TABLE_LAYERS} "
                              "(one per MoE layer)")
        for layer, v in self.layer_table.items():
            if layer < 0:
                raise ConfigError(f"{where}layer_table: layer {layer}: must be >= 0")
            _check_seconds(f"{where}layer_table[{layer}]", v)
        return self

    def layer_s(self, tokens: int, layer: int | None = None, misses: int = 0) -> float:
        base = self.per_layer_s if layer is None else self.layer_table.get(layer, self.per_layer_s)
        s = base + self.per_token_s * tokens
        return s + self.per_miss_s * misses if misses and self.per_miss_s else s


class LayerReport(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    requests: int  # experts acquired (one per distinct expert of each part)
    hits: int
    hit_rate: float
    belady_hit_rate: float
    side_hits: int = 0  # of `hits`, served from the side region (prefetched)
    prefetch_recall: float = 0.0  # fraction of the acquired experts that were hinted before


class PredictorOpts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A replay predictor's settings: `train_frac` of the log's first steps train (and are not replayed),
    or `train_log` does; `recall` and `seed` are the oracle's."""

    train_frac: float = 0.0
    train_log: str = ""
    recall: float = 1.0
    seed: int = 0


class PrefetchReport(msgspec.Struct, frozen=True, kw_only=True):
    """What prediction bought: hints' recall, and prefetch reads that a step used (useful) or never did (wasted)."""

    issued: int  # prefetch reads the pool issued
    reads: int  # ... that finished (side-region reads)
    useful: int  # finished or late prefetches a step used
    wasted: int  # finished prefetches no step used (evicted, cleared or still unused at the end)
    useful_bytes: int
    wasted_bytes: int
    expired: int  # not started: deadline passed
    dropped: int  # hinted experts not read (budgets, no side slot)
    recall: float  # fraction of acquired experts hinted beforehand
    precision: float  # useful / reads


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a replay measured, in virtual time (`steps` forwards: prefill chunks and decode steps)."""

    log: str
    predictor: str
    device: DeviceProfile
    cost: CostModel
    capacities: dict[int, int]
    steps: int
    tokens: int
    virtual_s: float
    tok_s: float  # steps per virtual second
    hit_rate: float
    misses_by_cause: dict[str, int]
    bytes_per_token: float  # per step
    stall_s_per_token: float  # per step
    device_utilisation: float  # fraction of the virtual time with a read in service
    reads: int
    layers: list[LayerReport]
    resident_hit_rate: float = 0.0  # hits from the resident slots / requests
    side_hit_rate: float = 0.0  # hits from the side region / requests (hit_rate = the two summed)
    prefetch: PrefetchReport | None = None  # None without a predictor
    predictor_opts: PredictorOpts = PredictorOpts()
    train_steps: int = 0  # the log's first steps used for training only, not replayed
    absent_layers: list[int] = []  # MoE layers the replayed steps never route through: not in `layers`
    warnings: list[str] = []  # numbers above that could mislead, said in words (qnpipe.replay.caveats)
    # The memory the run had: `capacities` are the resident slots; each layer also has `side_slots`
    # side-region slots (prefetch on only), in the same stacked array.
    prefetch_into: str = "side"  # pool.prefetch_into: where prefetches landed
    side_slots: int = 0  # side-region slots per layer
    slots: dict[int, int] = {}  # resident + side slots per layer
    record_nbytes: dict[int, int] = {}  # bytes of one expert record per layer
    memory_bytes: int = 0  # sum over layers of slots x record bytes

    def rows(self, settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The report as tidy rows, one per layer x metric (`layer` "all": the whole run), for a
        DataFrame or a CSV; `settings` (e.g. the config overrides) become columns too
        (qnpipe.replay.export.report_rows)."""
        from qnpipe.replay.export import report_rows

        return report_rows(self, settings)


class ReplayLog(msgspec.Struct, frozen=True, kw_only=True):
    """A log's routes by step: `steps[i]` = ((layer, experts [N*k]), ...) in layer order."""

    shape: ModelShape
    steps: list[list[tuple[int, tuple[int, ...]]]]
    record_nbytes: dict[int, int]  # from the log's read.done records (empty for a routing log)
    # the recorded predict.candidates: by steps' index, MoE layer -> ((target, width, experts, scores), ...)
    candidates: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...], tuple[float, ...]]]] = {}


def load_log(path: str | Path) -> ReplayLog:
    """The routes of a log, checked against its header's model shape (TraceSchemaError names the record)."""
    header, records = read(path)
    shape = _shape(path, header)
    moe = set(shape.moe_layers)
    by_step: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    nbytes: dict[int, int] = {}
    cands: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...], tuple[float, ...]]]] = {}
    for n, r in enumerate(records, start=1):
        if isinstance(r, ReadDone):
            nbytes[r.layer] = max(nbytes.get(r.layer, 0), r.nbytes)
        if isinstance(r, Candidates):
            if (r.layer not in moe or r.target not in moe or r.width < 1 or len(r.token_experts) % r.width
                    or len(r.token_scores) != len(r.token_experts)
                    or not all(0 <= e < shape.num_experts for e in r.token_experts)):
                raise TraceSchemaError(f"{path}: record {n} (predict.candidates step {r.step}): layers "
                                       f"{r.layer}->{r.target}, width {r.width}, {len(r.token_experts)} experts and "
                                       f"{len(r.token_scores)} scores do not fit the model")
            cands.setdefault((r.step, r.layer), []).append((r.target, r.width, r.token_experts, r.token_scores))
        if not isinstance(r, Route):
            continue
        why = None
        if r.layer not in moe:
            why = f"layer {r.layer} is not a MoE layer of the log's model {sorted(moe)}"
        elif r.top_k != shape.top_k or not r.experts or len(r.experts) % r.top_k:
            why = f"{len(r.experts)} experts at top_k={r.top_k} do not fit the model's top_k={shape.top_k}"
        elif not all(0 <= e < shape.num_experts for e in r.experts):
            why = f"an expert id outside 0..{shape.num_experts - 1}"
        if why is not None:
            raise TraceSchemaError(f"{path}: record {n} (trace.route step {r.step}): {why}")
        by_step.setdefault(r.step, []).append((r.layer, r.experts))
    if not by_step:
        raise TraceSchemaError(f"{path}: no trace.route records to replay")
    order = sorted(by_step)
    index = {s: i for i, s in enumerate(order)}
    return ReplayLog(shape=shape, steps=[by_step[s] for s in order], record_nbytes=nbytes,
                     candidates={(index[s], layer): c for (s, layer), c in cands.items() if s in index})


def _shape(path: str | Path, header: Header) -> ModelShape:
    if header.model is None:
        raise TraceSchemaError(f"{path}: record 0 (header) has no model shape: nothing to replay against")
    return header.model


def replay_capacities(cfg: Config, shape: ModelShape) -> dict[int, int]:
    """The config's slots per MoE layer of the log's model; ConfigError when they do not fit its shape."""
    path = cfg.pool.capacity_profile_path
    # Read here first, capped and regular files only: a FIFO given as the profile must not block.
    text = read_text_capped(path, CONFIG_CAP, error=ConfigError) if path else ""
    caps = layer_capacities(cfg, cast(Any, _ShapeArgs(shape)))
    if path:
        given = {int(k) for k in json.loads(text)["layer_caps"]}
        if extra := sorted(given - set(shape.moe_layers)):
            raise ConfigError(f"pool.capacity_profile_path={path}: layers {extra} are not MoE layers of the "
                              f"log's model (MoE layers {list(shape.moe_layers)}): a profile for another model?")
    return caps


class _ShapeArgs:
    """The three ModelArgs fields `layer_capacities` reads, from a log's ModelShape."""

    def __init__(self, shape: ModelShape) -> None:
        self.moe_layers = list(shape.moe_layers)
        self.num_experts = shape.num_experts
        self.num_experts_per_tok = shape.top_k


class LogBackend:
    """The forward's `Backend` over recorded routes: begin -> the first MoE layer's route,
    resume -> the modelled compute then the next route, `StepDone` after the last layer."""

    def __init__(self, log: ReplayLog, cost: CostModel, *,
                 predictions: list[list[Predictions]] | None = None) -> None:
        self._log = log
        self._cost = cost
        self._step = -1
        self._i = 0
        self.tokens = 0
        self._predictions = predictions  # [step][i]: what the predictor gets at the step's i-th MoE layer

    def _route(self) -> LayerRoute:
        layer, experts = self._log.steps[self._step][self._i]
        ids = np.asarray(experts, dtype=np.int64).reshape(-1, self._log.shape.top_k)
        preds = self._predictions[self._step][self._i] if self._predictions is not None else ()
        return LayerRoute(layer, ids, preds)

    async def begin(self, inputs: Any, cache: Any, tail: Tail) -> Event:
        self._step += 1
        self._i = 0
        self.tokens += len(self._log.steps[self._step][0][1]) // self._log.shape.top_k
        if self._cost.per_step_s:
            await trio.sleep(self._cost.per_step_s)
        return self._route()

    async def resume(self, grant: PartGrant) -> Event:
        await trio.sleep(self._cost.layer_s(grant.hi - grant.lo, self._log.steps[self._step][self._i][0],
                                            grant.misses))
        if not grant.last:
            return PartDone()
        self._i += 1
        if self._i == len(self._log.steps[self._step]):
            return StepDone(None)
        return self._route()

    async def abort(self) -> None:
        pass


def predictions(log: ReplayLog, predictor: str, opts: PredictorOpts, *, width: int,
                first: int = 0) -> list[list[Predictions]]:
    """What the predictor gets at each MoE layer of each replayed step (`log.steps[first:]`), by `predictor`:

    `recorded`: the log's own `predict.candidates` (the live gates' top-W); `previous`: the next
    layer routes as the previous token did; `transition`: the next layer's top-`width` experts
    by a `TransitionTable` learned from `log.steps[:first]` (or `opts.train_log`); `oracle`: the
    next layer's true experts at `opts.recall` (seeded by `opts.seed`). ConfigError when the log
    has nothing to learn from.
    """
    k, num = log.shape.top_k, log.shape.num_experts
    table: TransitionTable | None = None
    if predictor == "recorded" and not log.candidates:
        raise ConfigError("predictor 'recorded': the log has no predict.candidates records (a live run "
                          "with predict.cross_layer_prefetch=true and a trace records them)")
    if predictor == "transition":
        table = TransitionTable(log.shape.moe_layers, num)
        if opts.train_log:
            train = load_log(opts.train_log)
            if train.shape != log.shape:
                raise ConfigError(f"train_log={opts.train_log}: its model {train.shape} is not the log's {log.shape}")
            table.learn_steps(train.steps, k)
        elif first == 0:
            raise ConfigError("predictor 'transition' learns from the log's first steps or another log: "
                              "give train_frac > 0 (--train-frac) or train_log (--train-log)")
        else:
            table.learn_steps(log.steps[:first], k)
    rng = np.random.default_rng(opts.seed)
    before: dict[int, tuple[int, ...]] = dict(log.steps[first - 1]) if first > 0 else {}
    out: list[list[Predictions]] = []
    for j in range(first, len(log.steps)):
        step = log.steps[j]
        row: list[Predictions] = []
        for i, (layer, experts) in enumerate(step):
            preds: Predictions = ()
            nxt = step[i + 1] if i + 1 < len(step) else None
            if predictor == "recorded":
                preds = tuple((target, np.asarray(e, dtype=np.int64).reshape(-1, w),
                               np.asarray(sc, dtype=np.float64).reshape(-1, w))
                              for target, w, e, sc in log.candidates.get((j, layer), ()))
            elif nxt is not None:
                target, n = nxt[0], len(experts) // k
                guess = None
                if predictor == "previous" and target in before:
                    guess = previous_guess(before[target], n, k)
                elif table is not None and table.next_of.get(layer) == target:
                    guess = table.guess(layer, np.asarray(experts, dtype=np.int64).reshape(-1, k), width)
                elif predictor == "oracle":
                    guess = oracle_guess(np.asarray(nxt[1], dtype=np.int64).reshape(-1, k), num, opts.recall, rng)
                if guess is not None:
                    preds = ((target, *guess),)
            row.append(preds)
        out.append(row)
        before = dict(step)
    return out


def _belady(log: ReplayLog, caps: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Per layer (requests, Belady hits), the requests split into parts as the forward splits them."""
    seqs: dict[int, list[tuple[int, ...]]] = {layer: [] for layer in caps}
    for step in log.steps:
        for layer, experts in step:
            seqs[layer] += [ex for _, _, ex in plan_parts_flat(experts, log.shape.top_k, caps[layer], layer=layer)]
    return {layer: (sum(map(len, s)), belady_hits(s, caps[layer])) for layer, s in seqs.items()}


# A sweep replays one log at many settings in one worker process: its routes and each predictor's
# guesses are read and computed once there. Keyed by the file's identity, so a rewritten log is read again.
_LOADED: dict[tuple[str, int, int, int], tuple[ReplayLog, dict[tuple[Any, ...], list[list[Predictions]]]]] = {}


def _cached_log(path: str | Path) -> tuple[ReplayLog, dict[tuple[Any, ...], list[list[Predictions]]]]:
    try:
        st = os.stat(path)
    except OSError:
        return load_log(path), {}  # load_log says what is wrong with it
    if not stat.S_ISREG(st.st_mode):
        return load_log(path), {}
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _LOADED.get(key)
    if hit is None:
        loaded = (load_log(path), {})
        _LOADED.clear()  # one log at a time
        hit = _LOADED[key] = loaded
    return hit


def replay(log_path: str | Path, cfg: Config, *, device_profile: DeviceProfile | str = "apple-m5-internal",
           cost: CostModel | None = None, record_nbytes: int | None = None,
           predictor: str = "none", opts: PredictorOpts | None = None, driver: str = "fast") -> ReplayReport:
    """Replay `log_path` under `cfg`'s pool and read settings on a simulated device (see the module doc).

    `predictor`: "none" (demand only) or one of `predictions`' (recorded, previous, transition,
    oracle); any but "none" turns `predict.cross_layer_prefetch` on, with the config's prefetch
    budgets, ranking and side region. With `opts.train_frac`, the log's first steps train the
    predictor and only the rest is replayed (for every predictor, so reports compare).

    `record_nbytes` is the bytes of one expert record; by default the largest `read.done`
    of each layer in the log (a routing log has none: then it must be given).
    """
    cost = cost if cost is not None else CostModel()
    opts = opts if opts is not None else PredictorOpts()
    if driver not in DRIVERS:
        raise ConfigError(f"driver {driver!r}: unknown, known: {', '.join(DRIVERS)}")
    if predictor not in PREDICTORS:
        raise ConfigError(f"predictor {predictor!r}: unknown, known: {', '.join(PREDICTORS)}")
    if not 0.0 <= opts.train_frac < 1.0:
        raise ConfigError(f"train_frac={opts.train_frac}: must be in [0, 1)")
    if not 0.0 <= opts.recall <= 1.0:
        raise ConfigError(f"recall={opts.recall}: must be in [0, 1]")
    if opts.seed < 0:
        raise ConfigError(f"seed={opts.seed}: must be >= 0")
    if predictor != "none":
        cfg = with_overrides(cfg, {"predict.cross_layer_prefetch": True})
    check_placement(cfg)
    check_log_paths(cfg)  # a log that cannot be written fails now, not when the recorder opens it
    if isinstance(device_profile, str):
        device_profile = named_profile(device_profile, cfg.read.device_profile_path)
    device_profile.check(where="device.")
    cost.check()
    if record_nbytes is not None:
        check_record_nbytes(record_nbytes)
    log, guessed = _cached_log(log_path)
    first = int(len(log.steps) * opts.train_frac)
    if first >= len(log.steps):
        raise ConfigError(f"train_frac={opts.train_frac}: leaves none of the log's {len(log.steps)} steps to replay")
    preds = None
    if predictor != "none":
        key = (predictor, opts, cfg.predict.width_experts, first)
        preds = guessed.get(key) if not opts.train_log else None
        if preds is None:
            preds = predictions(log, predictor, opts, width=cfg.predict.width_experts, first=first)
            if not opts.train_log:  # another log's contents are not in the key
                guessed[key] = preds
    log = msgspec.structs.replace(log, steps=log.steps[first:], candidates={})
    caps = replay_capacities(cfg, log.shape)
    if record_nbytes is not None:
        nbytes = dict.fromkeys(caps, record_nbytes)
    elif set(caps) <= set(log.record_nbytes):
        nbytes = {layer: log.record_nbytes[layer] for layer in caps}
    else:
        raise ConfigError(f"{log_path}: the log has no read.done record of layers "
                          f"{caveats.spans(set(caps) - set(log.record_nbytes))}: give the record size "
                          f"(record_nbytes, --set replay.record_nbytes=N)")
    belady = _belady(log, caps)
    profile = device_profile
    if driver == "fast":
        res = _run_fast(log, cfg, caps, nbytes, cost, profile, preds)
    else:
        res = _run_actors(log, cfg, caps, nbytes, cost, profile, preds)
    counters, hits, misses, causes = res.pool.layers, res.pool.hits, res.pool.misses, res.pool.causes
    pstats = res.pool
    steps = len(log.steps)
    routed = {layer for step in log.steps for layer, _ in step}
    layers = []
    for layer in sorted(caps.keys() & routed):
        c = counters[layer]
        req, bh = belady[layer]
        layers.append(LayerReport(layer=layer, requests=c.hits + c.misses, hits=c.hits,
                                  hit_rate=_ratio(c.hits, c.hits + c.misses), belady_hit_rate=_ratio(bh, req),
                                  side_hits=c.side_hits, prefetch_recall=_ratio(c.predicted_used, c.used)))
    side = pstats.side_hits
    prefetch = None
    if predictor != "none":
        reads, useful = pstats.prefetch_reads, pstats.prefetch_used
        prefetch = PrefetchReport(
            issued=pstats.prefetches_issued, reads=reads, useful=useful, wasted=reads - useful,
            useful_bytes=sum(c.prefetch_used * nbytes[ly] for ly, c in counters.items()),
            wasted_bytes=sum((c.prefetch_reads - c.prefetch_used) * nbytes[ly] for ly, c in counters.items()),
            expired=pstats.prefetches_expired, dropped=pstats.hints_dropped_budget,
            recall=_ratio(pstats.predicted_used, pstats.used),
            precision=_ratio(useful, reads))
    elapsed = res.elapsed_s
    absent = caveats.absent_layers(log.shape, routed)
    side_n = side_slots(cfg)
    slots = {layer: cap + side_n for layer, cap in caps.items()}
    return ReplayReport(
        log=str(log_path), predictor=predictor, device=profile, cost=cost, capacities=caps, steps=steps,
        tokens=res.tokens, virtual_s=elapsed, tok_s=_ratio(steps, elapsed), hit_rate=_ratio(hits, hits + misses),
        misses_by_cause=dict(sorted(causes.items())), bytes_per_token=res.device_bytes / steps,
        stall_s_per_token=res.stall_s / steps, device_utilisation=_ratio(res.busy_s, elapsed),
        reads=res.device_reads, layers=layers, resident_hit_rate=_ratio(hits - side, hits + misses),
        side_hit_rate=_ratio(side, hits + misses), prefetch=prefetch, predictor_opts=opts, train_steps=first,
        absent_layers=absent, warnings=caveats.warnings(cfg, log.shape, absent, predictor),
        prefetch_into=str(cfg.pool.prefetch_into), side_slots=side_n, slots=slots, record_nbytes=dict(sorted(nbytes.items())),
        memory_bytes=sum(n * nbytes[layer] for layer, n in slots.items()))


def _run_fast(log: ReplayLog, cfg: Config, caps: dict[int, int], nbytes: dict[int, int], cost: CostModel,
              profile: DeviceProfile, preds: list[list[Predictions]] | None) -> RunResult:
    logs = SyncLogs(cfg, shape=log.shape, capacities=caps) if wanted_logs(cfg) else None
    try:
        run = FastReplay(log.steps, log.shape.top_k, log.shape.num_experts, cfg, capacities=caps, record_nbytes=nbytes,
                         cost=cost, profile=profile, predictions=preds, emit=logs.emit if logs is not None else None)
        res = run.run()
    except BaseException:
        if logs is not None:
            logs.abandon()
        raise
    if logs is not None:
        logs.close(run.reads_drained_t())
    return res


def _run_actors(log: ReplayLog, cfg: Config, caps: dict[int, int], nbytes: dict[int, int], cost: CostModel,
                profile: DeviceProfile, preds: list[list[Predictions]] | None) -> RunResult:
    async def main() -> RunResult:
        backend = LogBackend(log, cost, predictions=preds)
        t0 = trio.current_time()
        async with open_simssd(profile, nbytes, hop_s=cost.read_hop_s) as dev, \
                open_pipeline(cfg, backend, num_experts=log.shape.num_experts, capacities=caps, device=dev,
                              record_nbytes=nbytes, shape=log.shape, turns=Turnstile()) as p:
            for _ in log.steps:
                await p.forward.run(None, None, lambda h: None)
            elapsed = trio.current_time() - t0
            assert p.policy is not None
            return RunResult(pool=p.policy.statistics(), stall_s=p.forward.stats.stall_s, elapsed_s=elapsed,
                             busy_s=dev.busy_s(), device_reads=dev.stats.reads, device_bytes=dev.stats.bytes_read,
                             tokens=backend.tokens)

    try:
        return trio.run(main, clock=exact_clock())
    except BaseExceptionGroup as group:  # an actor's error (a StallError) comes wrapped in the nurseries' groups
        own: BaseException | None = group.subgroup(lambda x: isinstance(x, QnpipeError))
        if own is None:
            raise
        while isinstance(own, BaseExceptionGroup):
            own = own.exceptions[0]
        raise own from None


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def belady_total(r: ReplayReport) -> float:
    """Belady's hit rate over all layers: the per-layer optima weighted by requests."""
    requests = sum(x.requests for x in r.layers)
    return _ratio(sum(x.belady_hit_rate * x.requests for x in r.layers), requests)


def describe(r: ReplayReport) -> str:
    """The report as a table for a terminal: warnings first, the hit rate split into resident and
    prefetched-in-time hits (a prefetch hit is memory a demand-only run did not have)."""
    prefetched = r.prefetch is not None
    split = (f" = resident {r.resident_hit_rate:.3f} + prefetched in time {r.side_hit_rate:.3f}"
             if prefetched else "")
    lines = [f"replay of {r.log}: {r.steps} steps ({r.tokens} tokens) in {r.virtual_s:.4f} virtual s",
             *(f"  WARNING: {w}" for w in r.warnings),
             f"  hit rate {r.hit_rate:.3f}{split} (Belady {belady_total(r):.3f} at the resident slots)",
             f"  {r.tok_s:.2f} steps/s, misses {r.misses_by_cause or '{}'}",
             _memory_line(r),
             f"  {r.bytes_per_token / 2**20:.3f} MiB read and {r.stall_s_per_token * 1e3:.3f} ms stalled per step, "
             f"device busy {r.device_utilisation:.1%} ({r.reads} reads)",
             *([f"  prefetch ({r.predictor}): recall {r.prefetch.recall:.3f}, {r.prefetch.reads} reads: "
                f"{r.prefetch.useful} useful ({r.prefetch.useful_bytes / 2**20:.1f} MiB), {r.prefetch.wasted} wasted "
                f"({r.prefetch.wasted_bytes / 2**20:.1f} MiB); {r.prefetch.expired} expired, "
                f"{r.prefetch.dropped} dropped"] if r.prefetch is not None else []),
             f"  {'layer':>5} {'slots':>5} {'requests':>8} {'hits':>6}"
             + (f" {'resident':>8} {'in time':>7}" if prefetched else "") + f" {'hit rate':>8} {'belady':>7}"]
    lines += [f"  {x.layer:>5} {_slots(r, x.layer):>5} {x.requests:>8} {x.hits:>6}"
              + (f" {x.hits - x.side_hits:>8} {x.side_hits:>7}" if prefetched else "")
              + f" {x.hit_rate:>8.3f} {x.belady_hit_rate:>7.3f}" for x in r.layers]
    if r.absent_layers:
        lines.append(f"  (not shown: layers {caveats.spans(r.absent_layers)}, no route in the log)")
    return "\n".join(lines)


def _slots(r: ReplayReport, layer: int) -> str:
    return f"{r.capacities[layer]}+{r.side_slots}" if r.side_slots else str(r.capacities[layer])


def _span(values: Any) -> str:
    lo, hi = min(values, default=0), max(values, default=0)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _memory_line(r: ReplayReport) -> str:
    """Slots per layer (resident + side) and the memory they take: what a comparison must hold equal."""
    per_expert = _span(r.record_nbytes.values()) if r.record_nbytes else "?"
    return (f"  slots per layer: {_span(r.capacities.values())} resident + {r.side_slots} side = "
            f"{_span(r.slots.values())} (prefetch into {r.prefetch_into}); {per_expert} B per expert, "
            f"{r.memory_bytes / 2**20:.1f} MiB in all")


def to_json(r: ReplayReport) -> bytes:
    """The report as JSON: fields in declaration order, dicts in insertion order (sorted when built)."""
    return msgspec.json.encode(r)


__all__ = ["DRIVERS", "PREDICTORS", "CostModel", "LayerReport", "LogBackend", "PredictorOpts", "Predictions", "PrefetchReport",
           "ReplayLog", "ReplayReport", "belady_total", "describe", "load_log", "predictions", "replay", "replay_capacities", "to_json"]
