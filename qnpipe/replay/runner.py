"""Replay a routing or event log through the real pool and read scheduler, in virtual time.

    report = replay("run.qtrace", cfg, device_profile=PROFILES["apple-m5-internal"],
                    cost=CostModel(per_layer_s=2e-3, per_token_s=0.0))

The log's `trace.route` records stand in for the model (qnpipe.replay.log), each layer's compute
is modelled (qnpipe.replay.cost) and reads go to a simulated device: no model, no MLX work, no
threads, the same report on every run. Two drivers run the same policies: "fast" (the default,
qnpipe.replay.fast) runs the pipeline's cores on a plain event loop; "actors"
(qnpipe.replay.actor_driver) runs the live trio actors on a virtual clock, the reference. They
give the same report, byte for byte (tests/replay/test_drivers.py); only the actor driver loads
trio and qnpipe.actors. Each layer's Belady optimum (`qnpipe.replay.belady`) is reported beside it.

The report's types and text are in qnpipe.replay.report, the predictors in qnpipe.replay.predictors,
the settings read from text in qnpipe.replay.settings; their public names stay importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from qnpipe.config import Config, explicit_settings, with_overrides
from qnpipe.errors import ConfigError
from qnpipe.io.device_file import named_profile
from qnpipe.io.files import CONFIG_CAP, read_text_capped
from qnpipe.io.sim_model import DeviceProfile
from qnpipe.policy.build import check_placement, layer_capacities, parse_capacity_profile, side_slots
from qnpipe.policy.parts import Splitter
from qnpipe.replay import caveats
from qnpipe.replay.belady import belady_hits
from qnpipe.replay.cost import MAX_COST_S, MAX_TABLE_LAYERS, CostModel
from qnpipe.replay.fast import FastReplay, RunResult
from qnpipe.replay.log import ReplayLog, cached_log, load_log
from qnpipe.replay.predictors import PREDICTORS, Predictions, PredictorOpts, predictions
from qnpipe.replay.report import (
    LayerReport,
    PrefetchReport,
    ReplayReport,
    belady_total,
    describe,
    ratio,
    to_json,
)
from qnpipe.replay.settings import MAX_RECORD_NBYTES, STEP_ORDERS, check_opts, check_record_nbytes, setting_value
from qnpipe.trace import ModelShape, check_log_paths
from qnpipe.trace.logs import SyncLogs, wanted_logs

if TYPE_CHECKING:
    from qnpipe.replay.actor_driver import LogBackend

# "fast": the cores on a plain event loop (qnpipe.replay.fast); "actors": the live trio actors on a
# virtual clock, the reference. The same report, byte for byte (tests/replay/test_drivers.py).
DRIVERS = ("fast", "actors")


def replay_capacities(cfg: Config, shape: ModelShape) -> dict[int, int]:
    """The config's slots per MoE layer of the log's model; ConfigError when they do not fit its shape."""
    return _capacities(cfg, shape)[0]


def _capacities(cfg: Config, shape: ModelShape) -> tuple[dict[int, int], dict[int, int] | None]:
    """`replay_capacities`, and the capacity profile's `layer_caps` (None without one) for the report's warnings."""
    path = cfg.pool.capacity_profile_path
    # Read once, here, capped and regular files only: a FIFO given as the profile must not block.
    given = parse_capacity_profile(path, read_text_capped(path, CONFIG_CAP, error=ConfigError)) if path else None
    caps = layer_capacities(cfg, _ShapeArgs(shape), profile=given)
    if given is not None and (extra := sorted(set(given) - set(shape.moe_layers))):
        raise ConfigError(f"pool.capacity_profile_path={path}: layers {extra} are not MoE layers of the "
                          f"log's model (MoE layers {list(shape.moe_layers)}): a profile for another model?")
    return caps, given


class _ShapeArgs:
    """The three ModelArgs fields `layer_capacities` reads, from a log's ModelShape."""

    def __init__(self, shape: ModelShape) -> None:
        self.moe_layers = list(shape.moe_layers)
        self.num_experts = shape.num_experts
        self.num_experts_per_tok = shape.top_k


def _belady(log: ReplayLog, caps: dict[int, int], side: int = 0, split: Splitter | None = None
            ) -> dict[int, tuple[int, int, int]]:
    """Per layer (requests, Belady hits at the resident slots, Belady hits at resident + `side` slots: the
    run's whole memory), the requests split into parts as the forward splits them (`split`: the run's)."""
    split = split or Splitter(False)
    seqs: dict[int, list[tuple[int, ...]]] = {layer: [] for layer in caps}
    for step in log.steps:
        for layer, experts in step:
            seqs[layer] += [ex for _, _, ex in split.parts(experts, log.shape.top_k, caps[layer], layer)]
    out = {}
    for layer, s in seqs.items():
        at_caps = belady_hits(s, caps[layer])
        out[layer] = (sum(map(len, s)), at_caps, belady_hits(s, caps[layer] + side) if side else at_caps)
    return out


def replay(log_path: str | Path, cfg: Config, *, device_profile: DeviceProfile | str = "apple-m5-internal",
           cost: CostModel | None = None, record_nbytes: int | None = None,
           predictor: str = "none", opts: PredictorOpts | None = None, driver: str = "fast",
           step_order: str = "id") -> ReplayReport:
    """Replay `log_path` under `cfg`'s pool and read settings on a simulated device (see the module doc).

    `predictor`: "none" (demand only) or one of `predictions`' (recorded, previous, transition,
    oracle); any but "none" turns `predict.cross_layer_prefetch` on, with the config's prefetch
    budgets, ranking and side region. With `opts.train_frac`, the log's first steps train the
    predictor and only the rest is replayed (for every predictor, so reports compare).

    `record_nbytes` is the bytes of one expert record; by default the largest `read.done`
    of each layer in the log (a routing log has none: then it must be given).

    `step_order`: "id" serves a step's experts at a layer in ascending id (as the live forward does),
    "router" in the order the router names them (token after token), e.g. to compare with a simulator
    fed the log's requests one at a time (docs/pool.md, "Step order").
    """
    cost = cost if cost is not None else CostModel()
    opts = opts if opts is not None else PredictorOpts()
    if driver not in DRIVERS:
        raise ConfigError(f"driver {driver!r}: unknown, known: {', '.join(DRIVERS)}")
    if predictor not in PREDICTORS:
        raise ConfigError(f"predictor {predictor!r}: unknown, known: {', '.join(PREDICTORS)}")
    check_opts(opts)
    if step_order not in STEP_ORDERS:
        raise ConfigError(f"replay.step_order={step_order!r}: unknown, known: {', '.join(STEP_ORDERS)}")
    if step_order != "id" and driver != "fast":
        raise ConfigError(f"replay.step_order={step_order}: the fast driver's (the actors serve in id order)")
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
    log, guessed = cached_log(log_path)
    first = int(len(log.steps) * opts.train_frac)
    if first >= len(log.steps):
        raise ConfigError(f"train_frac={opts.train_frac}: leaves none of the log's {len(log.steps)} steps to replay")
    preds: list[list[Predictions]] | None = None
    if predictor != "none":
        width = min(cfg.predict.width_experts, log.shape.num_experts)  # above: clamped, and the report warns
        key = (predictor, opts, width, first)
        preds = guessed.get(key) if not opts.train_log else None
        if preds is None:
            preds = predictions(log, predictor, opts, width=width, first=first)
            if not opts.train_log:  # another log's contents are not in the key
                guessed[key] = preds
    log = msgspec.structs.replace(log, steps=log.steps[first:], candidates={})
    cfg, recorded, from_log = _recorded(cfg, log)
    caps, profile_caps = _capacities(cfg, log.shape)
    if recorded:
        caps = {layer: recorded.get(layer, cap) for layer, cap in caps.items()}
    if record_nbytes is not None:
        nbytes = dict.fromkeys(caps, record_nbytes)
    elif set(caps) <= set(log.record_nbytes):
        nbytes = {layer: log.record_nbytes[layer] for layer in caps}
    else:
        raise ConfigError(f"{log_path}: the log has no read.done record of layers "
                          f"{caveats.spans(set(caps) - set(log.record_nbytes))}: give the record size "
                          f"(record_nbytes, --set replay.record_nbytes=N)")
    side_n = side_slots(cfg)
    belady = _belady(log, caps, side_n, Splitter(cfg.forward.parts == "experts", router_order=step_order == "router"))
    profile = device_profile
    if driver == "fast":
        res = _run_fast(log, cfg, caps, nbytes, cost, profile, preds, router_order=step_order == "router")
    else:
        from qnpipe.replay.actor_driver import run_actors  # only here: it loads trio and the actors

        res = run_actors(log, cfg, caps, nbytes, cost, profile, preds)
    counters, hits, misses, causes = res.pool.layers, res.pool.hits, res.pool.misses, res.pool.causes
    pstats = res.pool
    steps = len(log.steps)
    routed = {layer for step in log.steps for layer, _ in step}
    layers = []
    for layer in sorted(caps.keys() & routed):
        c = counters[layer]
        req, bh, bh_all = belady[layer]
        layers.append(LayerReport(layer=layer, requests=c.hits + c.misses, hits=c.hits,
                                  hit_rate=ratio(c.hits, c.hits + c.misses), belady_hit_rate=ratio(bh, req),
                                  side_hits=c.side_hits, prefetch_recall=ratio(c.predicted_used, c.used),
                                  prefetch_hits=c.side_hits - c.victim_hits, victim_hits=c.victim_hits,
                                  belady_same_memory_hit_rate=ratio(bh_all, req)))
    side = pstats.side_hits
    prefetch = None
    if predictor != "none":
        reads, useful = pstats.prefetch_reads, pstats.prefetch_used
        prefetch = PrefetchReport(
            issued=pstats.prefetches_issued, reads=reads, useful=useful, wasted=reads - useful,
            useful_bytes=sum(c.prefetch_used * nbytes[ly] for ly, c in counters.items()),
            wasted_bytes=sum((c.prefetch_reads - c.prefetch_used) * nbytes[ly] for ly, c in counters.items()),
            expired=pstats.prefetches_expired, dropped=pstats.hints_dropped_budget,
            recall=ratio(pstats.predicted_used, pstats.used),
            precision=ratio(useful, reads))
    elapsed = res.elapsed_s
    absent = caveats.absent_layers(log.shape, routed)
    # The memory the replayed layers had: a log of some layers only says nothing of the others'.
    slots = {layer: cap + side_n for layer, cap in caps.items() if layer in routed}
    warned = caveats.warnings(cfg, log.shape, absent, predictor, profile=profile_caps)
    if predictor != "none":
        warned += caveats.no_prefetch(predictor, routed, pstats.prefetches_issued, log.steps, log.shape.top_k,
                                      into_main=cfg.pool.prefetch_into == "main")
    requests = sum(x.requests for x in layers)
    return ReplayReport(
        log=str(log_path), predictor=predictor, device=profile, cost=cost, capacities=caps, steps=steps,
        tokens=res.tokens, virtual_s=elapsed, tok_s=ratio(steps, elapsed), hit_rate=ratio(hits, hits + misses),
        misses_by_cause=dict(sorted(causes.items())), bytes_per_token=res.device_bytes / steps,
        stall_s_per_token=res.stall_s / steps, device_utilisation=ratio(res.busy_s, elapsed),
        reads=res.device_reads, layers=layers, resident_hit_rate=ratio(hits - side, hits + misses),
        side_hit_rate=ratio(side, hits + misses), prefetch=prefetch, predictor_opts=opts, train_steps=first,
        absent_layers=absent, warnings=warned,
        prefetch_into=str(cfg.pool.prefetch_into), side_slots=side_n, slots=slots, record_nbytes=dict(sorted(nbytes.items())),
        memory_bytes=sum(n * nbytes[layer] for layer, n in slots.items()),
        prefetch_hit_rate=ratio(side - pstats.victim_hits, hits + misses),
        victim_hit_rate=ratio(pstats.victim_hits, hits + misses),
        belady_same_memory_hit_rate=ratio(sum(x.belady_same_memory_hit_rate * x.requests for x in layers), requests),
        evict_policy=str(cfg.pool.evict_policy), step_order=step_order,
        settings_from_log=from_log)


# The settings that choose a replay's slots: when neither is given, the log's recorded slots are used.
_SLOT_SETTINGS = frozenset({"pool.expert_slots", "pool.capacity_profile_path"})


def _recorded(cfg: Config, log: ReplayLog) -> tuple[Config, dict[int, int], list[str]]:
    """The config with what the log recorded of its run (its header) where `cfg` was not given it: the slots per
    layer (`capacities`; neither pool.expert_slots nor pool.capacity_profile_path given) and pool.evict_policy.
    Also those slots ({}: the config's) and the settings taken from the log."""
    given = explicit_settings(cfg).keys()
    over: dict[str, object] = {}
    caps: dict[int, int] = {}
    if log.capacities and not _SLOT_SETTINGS & given:
        caps = dict(log.capacities)
        # pool.expert_slots as the largest recorded (what the warnings and a sweep's columns read); layers keep theirs
        over["pool.expert_slots"] = max(caps.values())
    if log.evict_policy and "pool.evict_policy" not in given and log.evict_policy != str(cfg.pool.evict_policy):
        over["pool.evict_policy"] = log.evict_policy
    return (with_overrides(cfg, over) if over else cfg), caps, list(over)


def _run_fast(log: ReplayLog, cfg: Config, caps: dict[int, int], nbytes: dict[int, int], cost: CostModel,
              profile: DeviceProfile, preds: list[list[Predictions]] | None, *, router_order: bool = False) -> RunResult:
    logs = SyncLogs(cfg, shape=log.shape, capacities=caps) if wanted_logs(cfg) else None
    try:
        run = FastReplay(log.steps, log.shape.top_k, log.shape.num_experts, cfg, capacities=caps, record_nbytes=nbytes,
                         cost=cost, profile=profile, predictions=preds, emit=logs.emit if logs is not None else None)
        run.core.router_order = router_order
        res = run.run()
    except BaseException:
        if logs is not None:
            logs.abandon()
        raise
    if logs is not None:
        logs.close(run.reads_drained_t())
    return res


def __getattr__(name: str) -> Any:
    if name == "LogBackend":  # the actor driver's, loaded on first use: it brings trio and the actors
        from qnpipe.replay.actor_driver import LogBackend

        return LogBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DRIVERS", "MAX_COST_S", "MAX_RECORD_NBYTES", "MAX_TABLE_LAYERS", "PREDICTORS", "CostModel", "LayerReport",
           "LogBackend", "PredictorOpts", "Predictions", "PrefetchReport", "ReplayLog", "ReplayReport",
           "belady_total", "check_record_nbytes", "describe", "load_log", "predictions", "replay",
           "replay_capacities", "setting_value", "to_json"]
