"""How the planner chooses: curves for the allocation, a few candidates checked by the exact fast replay.

1. The log's miss-ratio curves (qnpipe.replay.mrc: LRU and Belady at every capacity, one pass).
2. Each budget's resident slots allocated across layers on LRU's curve (qnpipe.plan.allocate: exact
   max-plus knapsack, so never below uniform on the curve).
3. Candidates at equal memory, each replayed by the fast replay (qnpipe.replay.replay) on the timing
   window: planned allocation with LRU and with LFU, uniform allocation with the better of the two and,
   when the log has the live gates' candidates (`predict.candidates`), the best demand-only one with
   prefetch into the main region (no side slots: the same memory). The fastest is kept; prefetch only
   when it is strictly faster than demand-only. What the user fixed (qnpipe.plan.fixed) narrows this:
   their eviction policy alone; prefetch never, or always (refused on a log without candidates).

The timing window is the log's last `window_layer_steps` layer-steps (whole steps; the whole log when
shorter): the replay skips the steps before it (PredictorOpts.train_frac), so a plan says exactly
which replay its figures are, and `replay_plan` runs that replay again.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from qnpipe.config import Config, EvictPolicy, PrefetchInto, with_overrides
from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_write
from qnpipe.io.simssd import DeviceProfile
from qnpipe.plan.allocate import Allocator, curve_hits, uniform_caps
from qnpipe.plan.fixed import SIDE_SLOTS, Fixed
from qnpipe.plan.plan_file import Candidate
from qnpipe.plan.prefill_parts import layer_extra_parts
from qnpipe.replay.mrc import Curve, MrcResult, mrc
from qnpipe.replay.mrc_lfu import lfu_curves
from qnpipe.replay.runner import CostModel, PredictorOpts, ReplayLog, ReplayReport, load_log, replay
from qnpipe.trace import ModelShape

WINDOW_LAYER_STEPS = 12_000  # ~1.5-2.5 s of fast replay per candidate on one core (docs/measurements.md)
POLICIES = ("lru", "lfu")


def same_shape(a: ModelShape, b: ModelShape) -> bool:
    """Routing shapes equal (a synthetic or imported log records no hidden size: 0 matches any)."""
    return ((a.num_layers, a.moe_layers, a.num_experts, a.top_k) == (b.num_layers, b.moe_layers, b.num_experts, b.top_k)
            and (0 in (a.hidden_size, b.hidden_size) or a.hidden_size == b.hidden_size))


def _brief(s: ModelShape) -> str:
    return f"{len(s.moe_layers)} MoE layers of {s.num_layers}, {s.num_experts} experts, top-{s.top_k}"


def window_frac(n_steps: int, first: int) -> float:
    """The train_frac with int(n_steps * frac) == first (replay's own rounding)."""
    frac = (first + 0.5) / n_steps if first else 0.0
    assert int(n_steps * frac) == first
    return frac


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed candidate: its settings and report."""

    candidate: Candidate
    capacities: dict[int, int]
    side_slots: int
    prefetch_into: PrefetchInto
    predictor: Literal["none", "recorded"]
    report: ReplayReport


class Search:
    """One log's curves and replays, shared by every budget planned on it."""

    def __init__(self, log_path: str | Path, cfg: Config, *, device: DeviceProfile, cost: CostModel,
                 record_nbytes: int, window_layer_steps: int = WINDOW_LAYER_STEPS,
                 work_dir: str | Path | None = None, say: Callable[[str], None] | None = None,
                 expect: ModelShape | None = None, fixed: Fixed | None = None, prefill: bool = True) -> None:
        self.path = str(log_path)
        self.cfg = cfg
        self.fixed = fixed or Fixed()
        self.device, self.cost, self.nbytes = device, cost, record_nbytes
        self.say = say or (lambda s: None)
        self.log: ReplayLog = load_log(log_path)
        shape = self.log.shape
        if expect is not None and not same_shape(shape, expect):
            raise ConfigError(f"--log {log_path}: a log of another model shape ({_brief(shape)}); the model is "
                              f"{_brief(expect)}")
        self.k, self.e = shape.top_k, shape.num_experts
        self.curves: MrcResult = mrc(self.log.steps, shape, log=self.path, by_expert=cfg.forward.parts == "experts")
        routed = {c.layer for c in self.curves.curves if c.layer != "all"}
        self.routed = [ly for ly in shape.moe_layers if ly in routed]
        self.absent = [ly for ly in shape.moe_layers if ly not in routed]  # never routed: top-k slots
        n = len(self.log.steps)
        per_step = max(1, sum(len(s) for s in self.log.steps) // n)
        keep = min(n, max(1, window_layer_steps // per_step))
        self.first = n - keep
        self.frac = window_frac(n, self.first)
        chunk = cfg.forward.prefill_chunk_tokens
        by_expert = cfg.forward.parts == "experts"
        self.parts, self.parts_source = (layer_extra_parts(self.log.steps, shape, chunk, by_expert=by_expert)
                                         if prefill else ({}, "none"))
        self.miss_ns, self.part_ns = miss_ns(device, cost, record_nbytes), part_ns(cost, self.routed)
        if prefill:
            self.say("prefill parts priced beside misses: " + (
                "the log's multi-token steps" if self.parts_source == "log" else
                f"chunks of {chunk or 'all'} of the log's tokens (forward.prefill_chunk_tokens; the log has no prefill)"))
        # The curve of each policy a candidate plans for: LFU's own when LFU is one (qnpipe.replay.mrc_lfu),
        # replayed at its grid over the timing window (what the candidates' replays count: a replay of the
        # whole log at each grid point per layer would cost minutes on a long log).
        self.policy_curves: dict[str, list[Curve]] = {"lru": [self.curves.curve("lru", ly) for ly in self.routed]}
        if self.fixed.policy in (None, "lfu") and self.routed:
            lfu = {c.layer: c for c in lfu_curves(self.log.steps[self.first:], shape,
                                                  decay_interval=cfg.pool.lfu_decay_interval_forwards,
                                                  by_expert=cfg.forward.parts == "experts")}
            self.policy_curves["lfu"] = [lfu.get(ly) or _flat(c) for ly, c in zip(
                self.routed, self.policy_curves["lru"], strict=True)]
        # Each curve's misses beside the parts of the same steps (the LFU curve's: the window's).
        window = layer_extra_parts(self.log.steps[self.first:], shape, chunk, by_expert=by_expert)[0] if prefill else {}
        parts_of = {"lru": self.parts, "lfu": window}
        self.values = {p: [self.layer_value(c, parts_of[p]) for c in cs] for p, cs in self.policy_curves.items()}
        self.value = self.values["lru"]
        self.allocs = {p: Allocator(v, self.k, self.e * len(self.routed)) for p, v in self.values.items()}
        self.alloc = self.allocs["lru"]
        self.has_candidates = bool(self.log.candidates)
        if work_dir is None:  # the candidates' capacity profiles: removed with the search (or at exit)
            work_dir = tempfile.mkdtemp(prefix="qnpipe-plan-")
            weakref.finalize(self, shutil.rmtree, work_dir, ignore_errors=True)
        self._dir = Path(work_dir)
        self._n = 0

    def layer_value(self, c: Curve, parts: dict[int, list[int]]) -> list[int]:
        """What a layer's capacities save, in ns (higher = better): minus its misses' reads and its prefill
        chunks' extra passes (qnpipe.plan.prefill_parts). Misses alone when no chunk splits: the same
        allocation as the misses' curve, every value scaled by one constant."""
        extra = parts.get(int(c.layer), [0] * len(c.hits))
        per_part = self.part_ns.get(int(c.layer), 0)
        return [-(r - h) * self.miss_ns - x * per_part for h, r, x in zip(c.hits, c.requests, extra, strict=True)]

    def curve_value(self, caps: dict[int, int], policy: str = "lru") -> int:
        """The allocation's objective at `caps` on `policy`'s curve (LRU's for a policy without its own)."""
        values = self.values.get(policy, self.value)
        return sum(v[caps[ly] - self.k] for v, ly in zip(values, self.routed, strict=True))

    def prefill_parts(self, caps: dict[int, int]) -> int:
        """The extra prefill passes at `caps`, over the chunks `parts_source` names."""
        return sum(self.parts[ly][caps[ly] - self.k] for ly in self.routed if ly in self.parts)

    @property
    def min_slots(self) -> int:
        return self.k * len(self.log.shape.moe_layers)

    @property
    def max_slots(self) -> int:
        return self.e * len(self.log.shape.moe_layers)

    def planned(self, total: int, policy: str = "lru") -> dict[int, int]:
        """The curve-optimal resident slots per MoE layer with at most `total` slots in all, on `policy`'s
        curve (LRU's for a policy without its own)."""
        spare = total - self.k * len(self.absent)
        alloc = self.allocs.get(policy, self.alloc)
        caps = dict(zip(self.routed, alloc.caps(spare), strict=True)) if self.routed else {}
        return {ly: caps.get(ly, self.k) for ly in self.log.shape.moe_layers}

    def uniform(self, total: int) -> dict[int, int]:
        layers = self.log.shape.moe_layers
        return dict(zip(layers, uniform_caps(len(layers), total, self.k, self.e), strict=True))

    def curve_rates(self, caps: dict[int, int]) -> tuple[float, float]:
        """(LRU, Belady) hit rates over the whole log at `caps`, from the curves."""
        out = []
        for policy in ("lru", "belady"):
            cs = [self.curves.curve(policy, ly) for ly in self.routed]
            hits = curve_hits([c.hits for c in cs], self.k, [caps[ly] for ly in self.routed])
            req = sum(c.requests[caps[ly] - self.k] for c, ly in zip(cs, self.routed, strict=True))
            out.append(hits / req if req else 0.0)
        return out[0], out[1]

    def overrides(self, caps: dict[int, int], policy: str, prefetch: bool) -> dict[str, object]:
        self._n += 1
        profile = self._dir / f"capacities-{self._n}.json"
        atomic_write(profile, msgspec.json.encode({"layer_caps": {str(k): v for k, v in caps.items()}}))
        return {"pool.capacity_profile_path": str(profile), "pool.evict_policy": policy, "pool.autopin": False,
                "predict.cross_layer_prefetch": prefetch, "pool.prefetch_into": "main" if prefetch else "side",
                "pool.side_region_slots": SIDE_SLOTS}

    def run(self, name: str, allocation: str, caps: dict[int, int], policy: str, prefetch: bool) -> Choice:
        predictor: Literal["none", "recorded"] = "recorded" if prefetch else "none"
        cfg = with_overrides(self.cfg, self.overrides(caps, policy, prefetch))
        t0 = time.perf_counter()
        r = replay(self.path, cfg, device_profile=self.device, cost=self.cost, record_nbytes=self.nbytes,
                   predictor=predictor, opts=PredictorOpts(train_frac=self.frac))
        self.say(f"  {name:<34} {r.tok_s:9.3f} tok/s  hit {r.hit_rate:.4f}  ({time.perf_counter() - t0:.1f} s)")
        lru, opt = self.curve_rates(caps)
        cand = Candidate(name=name, allocation=allocation, evict_policy=EvictPolicy(policy), prefetch=prefetch,
                         total_slots=sum(r.slots.values()), tok_s=r.tok_s, hit_rate=r.hit_rate,
                         bytes_per_token=r.bytes_per_token, curve_hit_rate=lru, belady_hit_rate=opt)
        return Choice(candidate=cand, capacities=caps, side_slots=SIDE_SLOTS,
                      prefetch_into=PrefetchInto.MAIN if prefetch else PrefetchInto.SIDE, predictor=predictor, report=r)

    def choose(self, total: int) -> tuple[Choice, list[Choice]]:
        """The fastest candidate at `total` resident slots, and every candidate replayed (module doc)."""
        if total < self.min_slots:
            raise ConfigError(f"{total} slots: below top-k ({self.k}) per MoE layer")
        total = min(total, self.max_slots)
        fixed = self.fixed
        if fixed.prefetch and not self.has_candidates:
            raise ConfigError(f"predict.cross_layer_prefetch=true, given, fixes prefetch on: a plan predicts "
                              f"prefetch from the live gates' candidates a log records (`qnpipe generate MODEL_DIR "
                              f"--trace run.qtrace --set predict.cross_layer_prefetch=true`, then --log run.qtrace); "
                              f"{self.path} has none")
        uniform = self.uniform(total)
        policies = (fixed.policy,) if fixed.policy is not None else POLICIES
        tried = [self.run(f"planned {p}", "planned", self.planned(total, p), p, False) for p in policies]
        best = max(tried, key=_rank)
        pol = best.candidate.evict_policy
        planned = best.capacities
        if uniform == planned:  # the same replay: not run twice
            tried.append(msgspec.structs.replace(best, candidate=msgspec.structs.replace(
                best.candidate, name=f"uniform {pol}", allocation="uniform")))
        else:
            tried.append(self.run(f"uniform {pol}", "uniform", uniform, pol, False))
        best = max(tried, key=_rank)
        if self.has_candidates and fixed.prefetch is not False:
            pre = self.run(f"{best.candidate.allocation} {pol} + prefetch (main)", best.candidate.allocation,
                           best.capacities, pol, True)
            tried.append(pre)
            if pre.candidate.tok_s > best.candidate.tok_s or fixed.prefetch:
                best = pre
        return best, tried


def _flat(c: Curve) -> Curve:
    """No requests at any capacity: a layer the timing window does not route."""
    zero = [0] * len(c.capacities)
    return Curve(policy="lfu", layer=c.layer, capacities=c.capacities, hits=zero, requests=zero)


def miss_ns(device: DeviceProfile, cost: CostModel, record_nbytes: int) -> int:
    """A miss's price in ns: its share of the device (a read in service, `queue_depth` at once, never
    above the bandwidth) and the compute after it (`cost.per_miss_s`)."""
    read = max(record_nbytes / device.bandwidth_bytes_per_s, device.service_s(record_nbytes) / device.queue_depth)
    return max(1, round((read + cost.per_miss_s) * 1e9))


def part_ns(cost: CostModel, layers: Sequence[int]) -> dict[int, int]:
    """An extra part's price in ns at each layer: one more pass of the layer (its per-token compute is
    the same split or not)."""
    return {ly: round(cost.layer_table.get(ly, cost.per_layer_s) * 1e9) for ly in layers}


def _rank(c: Choice) -> tuple[float, float, int]:
    return (c.candidate.tok_s, c.candidate.hit_rate, -c.candidate.total_slots)


def slot_totals(budgets: Sequence[int], fixed: int, record_nbytes: int) -> list[int]:
    """Resident slots each budget leaves for the pool after the fixed lines."""
    return [max(0, math.floor((b - fixed) / record_nbytes)) for b in budgets]


__all__ = ["POLICIES", "WINDOW_LAYER_STEPS", "Choice", "Search", "miss_ns", "part_ns", "same_shape", "slot_totals",
           "window_frac"]
