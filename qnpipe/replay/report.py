"""What a replay reports: the report's types, its text for a terminal, its JSON, its headline metrics
and its tidy rows (one per layer x metric; qnpipe.replay.export writes them as CSV or Parquet)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from qnpipe.io.sim_model import DeviceProfile
from qnpipe.replay import caveats
from qnpipe.replay.cost import CostModel
from qnpipe.replay.predictors import PredictorOpts

ALL_LAYERS = "all"  # the `layer` of a row about the whole run


class LayerReport(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    requests: int  # experts acquired (one per distinct expert of each part)
    hits: int
    hit_rate: float
    belady_hit_rate: float
    side_hits: int = 0  # of `hits`, served beyond the resident slots (prefetched in time, or victim-region hits)
    prefetch_recall: float = 0.0  # fraction of the acquired experts that were hinted before
    prefetch_hits: int = 0  # of `side_hits`, on experts a prefetch read brought in
    victim_hits: int = 0  # of `side_hits`, kept by the side region when the resident slots gave them up (no read)
    belady_same_memory_hit_rate: float = 0.0  # Belady at resident + side slots: the optimum at the run's memory


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
    side_hit_rate: float = 0.0  # hits beyond the resident slots / requests (hit_rate = the two summed)
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
    memory_bytes: int = 0  # sum over the reported layers of slots x record bytes
    # side_hit_rate split by cause: prefetch reads in time, and the side region keeping what the resident slots
    # gave up (pool.prefetch_into=main: a victim cache, no read); prefetch + victim = side.
    prefetch_hit_rate: float = 0.0
    victim_hit_rate: float = 0.0
    belady_same_memory_hit_rate: float = 0.0  # Belady at resident + side slots over all layers (= Belady without side)
    evict_policy: str = ""  # pool.evict_policy of the run
    settings_from_log: list[str] = []  # settings taken from the log's header (not given): e.g. "pool.expert_slots"
    step_order: str = "id"  # replay.step_order: a step's experts served in ascending id or the router's order

    def rows(self, settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The report as tidy rows, one per layer x metric (`layer` "all": the whole run), for a
        DataFrame or a CSV; `settings` (e.g. the config overrides) become columns too (`report_rows`)."""
        return report_rows(self, settings)


LAYER_METRICS = tuple(f for f in LayerReport.__struct_fields__ if f != "layer")


def ratio(a: float, b: float) -> float:
    """a / b, 0 when b is 0 (a rate of nothing)."""
    return a / b if b else 0.0


def belady_total(r: ReplayReport) -> float:
    """Belady's hit rate over all layers: the per-layer optima weighted by requests."""
    requests = sum(x.requests for x in r.layers)
    return ratio(sum(x.belady_hit_rate * x.requests for x in r.layers), requests)


def describe(r: ReplayReport) -> str:
    """The report as a table for a terminal: warnings first, the hit rate split into resident hits,
    prefetched-in-time hits (memory a demand-only run did not have) and, with pool.prefetch_into=main,
    the victim region's hits (the side region keeping what the resident slots gave up: no read)."""
    prefetched = r.prefetch is not None
    victims = prefetched and r.prefetch_into == "main"
    split = (f" = resident {r.resident_hit_rate:.3f} + prefetched in time {r.prefetch_hit_rate:.3f}"
             + (f" + victim region {r.victim_hit_rate:.3f}" if victims else "") if prefetched else "")
    belady = f"Belady {belady_total(r):.3f} at the resident slots"
    if r.side_slots:
        belady += f", {r.belady_same_memory_hit_rate:.3f} at resident + side (the same memory)"
    lines = [f"replay of {r.log}: {r.steps} steps ({r.tokens} tokens) in {r.virtual_s:.4f} virtual s",
             *(f"  WARNING: {w}" for w in r.warnings),
             f"  hit rate {r.hit_rate:.3f}{split} ({belady})",
             f"  {r.tok_s:.2f} steps/s, misses {_causes(r.misses_by_cause)}",
             _memory_line(r),
             f"  {r.bytes_per_token / 2**20:.3f} MiB read and {r.stall_s_per_token * 1e3:.3f} ms stalled per step, "
             f"device busy {r.device_utilisation:.1%} ({r.reads} reads)",
             *([f"  prefetch ({r.predictor}): recall {r.prefetch.recall:.3f}, {r.prefetch.reads} reads: "
                f"{r.prefetch.useful} useful ({r.prefetch.useful_bytes / 2**20:.1f} MiB), {r.prefetch.wasted} wasted "
                f"({r.prefetch.wasted_bytes / 2**20:.1f} MiB); {r.prefetch.expired} expired, "
                f"{r.prefetch.dropped} dropped"] if r.prefetch is not None else []),
             *([f"  as the log was recorded: {', '.join(_from_log(r))} (not given; --set overrides)"]
               if r.settings_from_log else []),
             f"  {'layer':>5} {'slots':>5} {'requests':>8} {'hits':>6}"
             + (f" {'resident':>8} {'in time':>7}" if prefetched else "") + (f" {'victim':>6}" if victims else "")
             + f" {'hit rate':>8} {'belady':>7}"]
    lines += [f"  {x.layer:>5} {_slots(r, x.layer):>5} {x.requests:>8} {x.hits:>6}"
              + (f" {x.hits - x.side_hits:>8} {x.side_hits - x.victim_hits:>7}" if prefetched else "")
              + (f" {x.victim_hits:>6}" if victims else "")
              + f" {x.hit_rate:>8.3f} {x.belady_hit_rate:>7.3f}" for x in r.layers]
    if r.absent_layers:
        lines.append(f"  (not shown: layers {caveats.spans(r.absent_layers)}, no route in the log)")
    return "\n".join(lines)


def _from_log(r: ReplayReport) -> list[str]:
    """The settings a replay took from its log's header, with their values."""
    out = []
    for key in r.settings_from_log:
        if key == "pool.expert_slots":
            out.append(f"slots {_span(r.capacities.values())} per layer ({key})")
        elif key == "pool.evict_policy":
            out.append(f"{r.evict_policy} eviction ({key})")
        else:
            out.append(key)
    return out


def _causes(causes: Mapping[str, int]) -> str:
    """Misses by cause as words: "cold 12, capacity 30" ("none" without a miss)."""
    return ", ".join(f"{k} {n}" for k, n in causes.items()) or "none"


def _slots(r: ReplayReport, layer: int) -> str:
    return f"{r.capacities[layer]}+{r.side_slots}" if r.side_slots else str(r.capacities[layer])


def _span(values: Any) -> str:
    lo, hi = min(values, default=0), max(values, default=0)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _memory_line(r: ReplayReport) -> str:
    """Slots per layer (resident + side) and the memory they take: what a comparison must hold equal."""
    per_expert = _span(r.record_nbytes.values()) if r.record_nbytes else "?"
    where = f"prefetch into {r.prefetch_into}" if r.prefetch is not None else "prefetch off"
    policy = f"{r.evict_policy} eviction, " if r.evict_policy else ""
    order = "" if r.step_order == "id" else f", experts in {r.step_order} order"
    return (f"  slots per layer: {_span(r.capacities.values())} resident + {r.side_slots} side = "
            f"{_span(r.slots.values())} ({policy}{where}{order}); {per_expert} B per expert, "
            f"{r.memory_bytes / 2**20:.1f} MiB in all")


def to_json(r: ReplayReport) -> bytes:
    """The report as JSON: fields in declaration order, dicts in insertion order (sorted when built)."""
    return msgspec.json.encode(r)


def metric_names() -> tuple[str, ...]:
    """The metrics a sweep can plot: the report's numeric fields, `misses`, `belady_hit_rate` and
    `slots_per_layer` (resident + side, averaged over layers)."""
    info = msgspec.inspect.type_info(ReplayReport)
    assert isinstance(info, msgspec.inspect.StructType)
    numeric = [f.name for f in info.fields
               if isinstance(f.type, msgspec.inspect.IntType | msgspec.inspect.FloatType)]
    return tuple(dict.fromkeys([*numeric, "misses", "belady_hit_rate", "slots_per_layer"]))


def metrics(r: ReplayReport) -> dict[str, float]:
    """The report's headline numbers by name (`metric_names`); `belady_hit_rate` over all layers
    when the report does not give it (the per-layer optima weighted by requests)."""
    out = {name: float(getattr(r, name)) for name in metric_names() if hasattr(r, name)}
    out["misses"] = float(sum(r.misses_by_cause.values()))
    out["slots_per_layer"] = sum(r.slots.values()) / len(r.slots) if r.slots else 0.0
    if "belady_hit_rate" not in out:
        requests = sum(x.requests for x in r.layers)
        out["belady_hit_rate"] = sum(x.belady_hit_rate * x.requests for x in r.layers) / requests if requests else 0.0
    return out


def fmt_value(v: Any) -> str:
    """A setting's value as short text: floats to 6 digits, sequences comma-joined ("-" when empty)."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list | tuple):
        return ",".join(map(str, v)) or "-"
    return str(v)


def cell(v: Any) -> Any:
    """A setting as one table cell: scalars as they are, sequences and mappings as text (a layer set: "0,1,2")."""
    if isinstance(v, list | tuple | dict):
        return fmt_value(v) if not isinstance(v, dict) else msgspec.json.encode(v).decode()
    return v


def report_settings(r: ReplayReport) -> dict[str, Any]:
    """The settings a report records about itself, as columns: its log, predictor and options, cost and device."""
    out: dict[str, Any] = {"log": r.log, "replay.predictor": r.predictor}
    out |= {f"replay.{k}": v for k, v in msgspec.structs.asdict(r.predictor_opts).items()}
    out |= {f"cost.{k}": cell(v) for k, v in msgspec.structs.asdict(r.cost).items()}
    out |= {f"device.{k}": cell(v) for k, v in msgspec.structs.asdict(r.device).items()}
    return out


def _run_metrics(r: ReplayReport) -> dict[str, float]:
    out = metrics(r)
    out |= {f"misses.{cause}": float(n) for cause, n in r.misses_by_cause.items()}
    if r.prefetch is not None:
        out |= {f"prefetch.{k}": float(v) for k, v in msgspec.structs.asdict(r.prefetch).items()}
    return out


def report_rows(r: ReplayReport, settings: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The report's rows (the columns: qnpipe.replay.export's doc); `settings` are extra columns (given first, they win on a clash)."""
    cols = {k: cell(v) for k, v in (settings or {}).items()}
    cols |= {k: v for k, v in report_settings(r).items() if k not in cols}
    rows = [{**cols, "layer": ALL_LAYERS, "metric": m, "value": v} for m, v in _run_metrics(r).items()]
    for x in r.layers:
        values = {m: float(getattr(x, m)) for m in LAYER_METRICS} | {"slots": float(r.capacities[x.layer])}
        rows += [{**cols, "layer": x.layer, "metric": m, "value": v} for m, v in values.items()]
    return rows


__all__ = ["ALL_LAYERS", "LAYER_METRICS", "LayerReport", "PrefetchReport", "ReplayReport", "belady_total", "cell",
           "describe", "fmt_value", "metric_names", "metrics", "ratio", "report_rows", "report_settings", "to_json"]
