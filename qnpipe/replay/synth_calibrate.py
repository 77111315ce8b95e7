"""Synthetic logs calibrated to published per-layer hit-rate points (`qnpipe trace synth --calibrate`).

    targets = parse_targets("lru:64=0.67,lru:128=0.81,hot:32=0.10")
    spec, got = calibrate(SynthSpec(layers=48, experts=512, top_k=10, tokens=2000, seed=1), targets)

Two knobs of `SynthSpec` are fitted, in this order, each by bisection (each point is monotone in its knob):

- `popularity="zipf:A"`: A such that a static hot list of the `hot:K` most used experts of a layer
  covers the target share of its traffic: first the stationary share of the top K Zipf ranks, then
  (once the reuse below is fitted) as the published figure was measured, a list learned on the log's
  first half scored on its second (`hot_share_learned`), after which the reuse is fitted again;
- `locality`: the probability a token reuses an earlier token's expert, such that the per-layer LRU
  hit rate at the first `lru:C` capacity lands on its target (what `qnpipe replay --mrc` reports:
  every request of the log, cold start included);
- `reuse_depth` (with more than one `lru:` point): of `DEPTHS`, the one whose fitted log is nearest the
  other points (least squares): how far back the reused expert's token is sets the curve's slope.
  `calibrate` returns what the log gives at every point, to be compared with the targets.

The fit runs on a log of `FIT_LAYERS` layers (each layer of a synthetic log is drawn alike, so its
per-layer curves are those of any layer count), then the spec keeps the caller's layer count.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from qnpipe.errors import ConfigError
from qnpipe.replay.synth import SynthSpec, synth
from qnpipe.trace import ModelShape

FIT_LAYERS = 8
STEPS = 14  # bisection steps per knob: 2^-14 of its range
DEPTHS = (1, 2, 4, 6, 8, 12, 16, 24, 32)  # reuse depths tried when there are further LRU points to fit


class Targets(msgspec.Struct, frozen=True, kw_only=True):
    """Per-layer LRU hit rates by capacity, and a hot list's share of traffic (`hot_k` = 0: none)."""

    lru: dict[int, float]
    hot_k: int = 0
    hot_share: float = 0.0


def parse_targets(text: str) -> Targets:
    """`lru:C=RATE` (one or more) and at most one `hot:K=SHARE`, comma-separated."""
    lru: dict[int, float] = {}
    hot_k, share = 0, 0.0
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            key, value = part.split("=")
            kind, n = key.split(":")
            cap, rate = int(n), float(value)
        except ValueError:
            raise ConfigError(f"--calibrate {part!r}: expected lru:CAPACITY=RATE or hot:K=SHARE") from None
        if not 0.0 < rate < 1.0 or cap < 1:
            raise ConfigError(f"--calibrate {part!r}: the rate must be in (0, 1) and the size >= 1")
        if kind == "lru":
            lru[cap] = rate
        elif kind == "hot" and not hot_k:
            hot_k, share = cap, rate
        else:
            raise ConfigError(f"--calibrate {part!r}: expected lru:CAPACITY=RATE or one hot:K=SHARE")
    if not lru:
        raise ConfigError(f"--calibrate {text!r}: give at least one lru:CAPACITY=RATE point")
    return Targets(lru=dict(sorted(lru.items())), hot_k=hot_k, hot_share=share)


def zipf_share(a: float, experts: int, k: int) -> float:
    """The share of traffic of the `k` most popular of `experts` experts under Zipf(a)."""
    w = 1.0 / np.arange(1, experts + 1) ** a
    return float(w[:k].sum() / w.sum())


def lru_rates(spec: SynthSpec, capacities: list[int]) -> dict[int, float]:
    """The per-layer LRU hit rate (all layers' hits over all their requests) of `spec`'s log at each capacity."""
    from qnpipe.replay.mrc import mrc

    routes = synth(spec)
    steps = [[(layer, experts) for layer, experts in enumerate(row)] for row in routes]
    shape = ModelShape(num_layers=spec.layers, moe_layers=tuple(range(spec.layers)), num_experts=spec.experts,
                       top_k=spec.top_k, hidden_size=0)
    curve = mrc(steps, shape, policies=("lru",)).curve("lru")
    rate = dict(zip(curve.capacities, curve.hit_rate(), strict=True))
    return {c: rate[c] for c in capacities}


def hot_share_learned(spec: SynthSpec, k: int) -> float:
    """A hot list of each layer's `k` most used experts in the log's first half: its share of the second half."""
    routes = synth(spec)
    half = len(routes) // 2
    covered = total = 0
    for layer in range(spec.layers):
        first = np.bincount([e for row in routes[:half] for e in row[layer]], minlength=spec.experts)
        hot = set(np.argsort(-first, kind="stable")[:k].tolist())
        second = [e for row in routes[half:] for e in row[layer]]
        covered += sum(e in hot for e in second)
        total += len(second)
    return covered / total if total else 0.0


def _bisect(f: Callable[[float], float], lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] where the increasing `f(x)` crosses `target` (an end when it does not)."""
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _fit_reuse(fit: SynthSpec, targets: Targets) -> SynthSpec:
    """`fit` with `locality` (bisection on the first LRU point) at the depth of `DEPTHS` nearest the others."""
    caps = list(targets.lru)
    cap, want = caps[0], targets.lru[caps[0]]
    best: tuple[float, SynthSpec] | None = None
    for depth in DEPTHS if len(caps) > 1 else (1,):
        at = msgspec.structs.replace(fit, reuse_depth=depth)
        loc = _bisect(lambda x, at=at: lru_rates(msgspec.structs.replace(at, locality=x), [cap])[cap], 0.0, 1.0, want)
        cand = msgspec.structs.replace(at, locality=round(loc, 5))
        err = sum((r - targets.lru[c]) ** 2 for c, r in lru_rates(cand, caps).items())
        if best is None or err < best[0]:
            best = (err, cand)
    assert best is not None
    return best[1]


def calibrate(spec: SynthSpec, targets: Targets) -> tuple[SynthSpec, dict[str, float]]:
    """`spec` with `popularity` and `locality` fitted to `targets` (module doc), and what its log gives:
    `lru:C` the per-layer LRU hit rate at each target capacity, `hot:K` the learned hot list's share."""
    spec.check()
    if max(targets.lru) > spec.experts or targets.hot_k > spec.experts:
        raise ConfigError(f"--calibrate: a capacity or hot list above the {spec.experts} experts")
    pop = spec.popularity
    if targets.hot_k:
        floor = targets.hot_k / spec.experts
        if targets.hot_share <= floor:
            raise ConfigError(f"--calibrate hot:{targets.hot_k}={targets.hot_share}: at or below uniform routing's "
                              f"{floor:.4f}: no Zipf skew gives it")
        a = _bisect(lambda x: zipf_share(x, spec.experts, targets.hot_k), 0.0, 3.0, targets.hot_share)
        pop = f"zipf:{a:.5f}"
    fit = _fit_reuse(msgspec.structs.replace(spec, layers=min(spec.layers, FIT_LAYERS), popularity=pop), targets)
    if targets.hot_k:  # the published share is of a list learned on half the log: fit that, then the reuse again
        a = _bisect(lambda x: hot_share_learned(msgspec.structs.replace(fit, popularity=f"zipf:{x:.5f}"), targets.hot_k),
                    0.0, 3.0, targets.hot_share)
        pop = f"zipf:{a:.5f}"
        fit = _fit_reuse(msgspec.structs.replace(fit, popularity=pop), targets)
    out = msgspec.structs.replace(spec, popularity=pop, locality=fit.locality, reuse_depth=fit.reuse_depth)
    got = {f"lru:{c}": r for c, r in lru_rates(out, list(targets.lru)).items()}
    if targets.hot_k:
        got[f"hot:{targets.hot_k}"] = hot_share_learned(out, targets.hot_k)
    return out, got


__all__ = ["FIT_LAYERS", "Targets", "calibrate", "hot_share_learned", "lru_rates", "parse_targets", "zipf_share"]
