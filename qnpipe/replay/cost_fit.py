"""The compute cost model of a live run, fitted from its event log (`qnpipe trace fit-cost`).

    fit = fit_cost("run.qtrace")          # CostFit: the CostModel, its residual, what it saw
    save_cost("run.cost.json", fit)
    replay("run.qtrace", cfg, cost=load_cost("run.cost.json").cost)

What a replay models as compute is everything the forward does between one layer part's
grant and its next acquire: the experts' work, the layers up to the next MoE router, and the
actors' messaging. The log holds it as the gap between consecutive `pool.acquire` records
(the forward's own stamps, in its `seq` order), minus the part's wait when it had misses
(`pool.granted` t - `pool.acquire` t: the device, which the replay models itself). A hit's
wait stays in the gap: the replay's pool answers a hit in no virtual time, the live one in a
few message hops. Each gap is one sample

    gap = per_layer_s + per_token_s * tokens + per_step_s * [the next acquire is the next step's]
          (+ per_miss_s * misses, with `per_miss`)

with `tokens` the part's token count (`plan_parts` on the `trace.route`, as the forward
splits it; the header's capacities; for a layer-step whose parts acquired disjoint experts, as
expert-major parts do, the part's (token, expert) pairs / top-k, which is also a disjoint token
range's count) and `misses` the experts its grant read. `fit_cost`
solves it by least squares over every gap of the log (or of several logs together: runs at
several capacities tell the misses' term from the intercept; runs at several times average a
busy machine's load); a coefficient the log cannot determine (every part of one token count: no
per_token_s; one step: no per_step_s) or that comes out negative is fixed at 0 and the rest
refitted. With `per_layer`, each MoE layer gets its own intercept (`layer_table`; the gap of
a part of layer L holds L's experts and the next layer's work up to its router); a term the
layer intercepts already explain is left out (in decode the last layer's gaps are all step
boundaries, so `per_step_s` goes into that layer's entry). The last part of the log has no
next acquire and is not a sample. The log does not
mark where one generate call ends and the next begins, so a step boundary more than
`PAUSE_FACTOR` (10) times the median boundary is taken for the caller's pause between calls
and left out (`CostFit.pauses` counts them).

`per_miss_s` (with `per_miss`): what a miss costs the forward beyond its wait. Measured on the
shared 2-core VM (docs/measurements.md, "The budget holds, live"): a part's gap grows by
~0.4-0.6 ms per expert its grant read (the reader's threads and the read scheduler's messages
share the cores with the compute), so a cost fitted at one hit rate without it predicts too
little gain at a higher one.

`read_hop_s` (given the device profile the replay will use): the live miss path's time beyond
that device, the mean over the parts with misses of their wait (`pool.granted` t -
`pool.acquire` t) less the time the profile takes to read their misses alone
(`ceil(misses / queue_depth) * service_s(record bytes)`): the messages to the read
scheduler and back, the hand-off to the reader's threads, and on a busy machine the wait
for a core. The replay adds it to each read batch (with demand reads, one per such part).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from qnpipe.errors import ConfigError, TraceSchemaError
from qnpipe.io.sim_model import DeviceProfile
from qnpipe.io.versioned import load_versioned, save_versioned
from qnpipe.messages import Acquire, Granted, ReadDone
from qnpipe.policy.parts import plan_parts
from qnpipe.replay.cost import CostModel
from qnpipe.trace import Route, read

COST_KIND = "qnpipe.cost-model"
COST_VERSION = 1
TERMS = ("per_layer_s", "per_token_s", "per_step_s", "read_hop_s", "per_miss_s")
COLUMNS = ("per_token_s", "per_step_s", "per_miss_s")  # the gaps' regressors after the intercept(s)
PAUSE_FACTOR = 10.0


class CostFit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The cost file `qnpipe trace fit-cost` writes and `qnpipe replay --cost` reads."""

    kind: str = COST_KIND
    version: int = COST_VERSION
    cost: CostModel
    log: str
    samples: int  # gaps fitted
    pauses: int  # step boundaries left out as pauses between generate calls (see fit_cost)
    steps: int
    fitted: list[str]  # the terms the least squares determined (the others are 0)
    rms_residual_s: float
    mean_gap_s: float
    live_s: float  # the time from the first acquire to the last (pauses included)
    miss_parts: int = 0  # the samples of read_hop_s
    read_hop_rms_residual_s: float = 0.0
    device: DeviceProfile | None = None  # the profile read_hop_s was fitted against (None: read_hop_s is 0)


class CostFitError(TraceSchemaError):
    """The log cannot give a cost model (no acquires, no grants to pair them with); names the file."""


def fit_cost(path: str | Path | Sequence[str | Path], device: DeviceProfile | None = None, *,
             per_layer: bool = False, per_miss: bool = False) -> CostFit:
    """The least-squares `CostModel` of the event log at `path` (see the module doc), or of the
    gaps of several logs together (a list: e.g. runs at several capacities, or taken at several
    times on a busy machine); with `device`, also its `read_hop_s` against that device;
    `per_layer`: one `per_layer_s` per MoE layer (`CostModel.layer_table`) instead of one for all;
    `per_miss`: also `per_miss_s`, the gap's growth with the part's misses."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise CostFitError("fit_cost: no log given")
    logs = [_samples(p) for p in paths]
    x = np.concatenate([g.x for g in logs])
    y = np.concatenate([g.y for g in logs])
    layer_of = np.concatenate([g.layers for g in logs])
    waits = [w for g in logs for w in g.waits]
    table_layers = sorted(set(layer_of.tolist())) if per_layer else []
    base = (np.stack([layer_of == la for la in table_layers], axis=1).astype(np.float64) if per_layer
            else np.ones((len(y), 1)))
    design = np.concatenate([base, x], axis=1)  # intercept(s), tokens, step boundary, misses
    nb = base.shape[1]
    # In the order they are given up: the step term first, then tokens, the misses last.
    extra = [nb + j for j in ((2, 0, 1) if per_miss else (0, 1)) if np.ptp(x[:, j]) > 0]
    # A term the intercepts already explain (per layer: the last layer's gaps are all step
    # boundaries in decode) cannot be told apart: leave it out, the step term first.
    while extra and np.linalg.matrix_rank(design[:, list(range(nb)) + extra]) < nb + len(extra):
        extra.pop()
    while True:
        use = list(range(nb)) + extra
        coef, *_ = np.linalg.lstsq(design[:, use], y, rcond=None)
        negative = [j for j, c in zip(use, coef, strict=True) if c < 0 and j >= nb]
        if not negative:
            break
        extra.remove(negative[0])
    full = np.zeros(design.shape[1])
    full[use] = coef
    full[:nb] = np.maximum(full[:nb], 0.0)
    resid = y - design @ full
    hop, hop_resid = _read_hop(waits, device) if device is not None and waits else (0.0, 0.0)
    table = {int(la): float(c) for la, c in zip(table_layers, full[:nb], strict=True)} if per_layer else {}
    # Without a table entry a layer costs the mean: the table's, weighted by its samples.
    per_layer_s = float(np.mean(design[:, :nb] @ full[:nb]))
    cost = CostModel(per_layer_s=per_layer_s, per_token_s=float(full[nb]), per_step_s=float(full[nb + 1]),
                     read_hop_s=hop, layer_table=table, per_miss_s=float(full[nb + 2]))
    names = ["layer_table" if per_layer else "per_layer_s"] + [COLUMNS[j - nb] for j in sorted(extra)]
    return CostFit(cost=cost, log=", ".join(str(p) for p in paths), samples=len(y),
                   pauses=sum(g.pauses for g in logs), steps=sum(g.steps for g in logs),
                   fitted=names + (["read_hop_s"] if hop else []),
                   rms_residual_s=float(np.sqrt(np.mean(resid**2))), mean_gap_s=float(y.mean()),
                   live_s=sum(g.live_s for g in logs), miss_parts=len(waits), read_hop_rms_residual_s=hop_resid,
                   device=device)


class _Samples(msgspec.Struct, frozen=True, kw_only=True):
    """One log's gaps (pauses left out): x = [tokens, step boundary, misses] per gap."""

    x: np.ndarray
    y: np.ndarray
    layers: np.ndarray
    waits: list[tuple[float, int, int]]  # (live wait, misses, record bytes) of each part with misses
    pauses: int
    steps: int
    live_s: float


def _samples(path: str | Path) -> _Samples:
    header, records = read(path)
    if header.model is None:
        raise CostFitError(f"{path}: record 0 (header) has no model shape")
    k = header.model.top_k
    routes: dict[tuple[int, int], Route] = {}
    acquires: list[Acquire] = []
    nbytes: dict[int, int] = {}
    grants: dict[tuple[int, int, int], Granted] = {}
    for r in records:
        if isinstance(r, Route):
            routes[(r.step, r.layer)] = r
        elif isinstance(r, Acquire):
            acquires.append(r)
        elif isinstance(r, Granted):
            grants[(r.step, r.layer, r.part)] = r
        elif isinstance(r, ReadDone):
            nbytes[r.layer] = max(nbytes.get(r.layer, 0), r.nbytes)
    acquires.sort(key=lambda a: a.seq)
    if len(acquires) < 2:
        raise CostFitError(f"{path}: {len(acquires)} pool.acquire record(s): a cost fit needs a streamed run's event "
                           "log (qnpipe generate --trace, with experts not all resident)")
    part_tokens: dict[tuple[int, int, int], float] = {}
    acquired: dict[tuple[int, int], list[Acquire]] = {}
    for a in acquires:
        acquired.setdefault((a.step, a.layer), []).append(a)
    rows: list[tuple[float, float, float]] = []
    gaps: list[float] = []
    layers: list[int] = []
    live_s = 0.0
    waits: list[tuple[float, int, int]] = []
    for a, nxt in zip(acquires, acquires[1:], strict=False):
        key = (a.step, a.layer, a.part)
        g = grants.get(key)
        if g is None:
            raise CostFitError(f"{path}: pool.acquire (step {a.step}, layer {a.layer}, part {a.part}) has no "
                               "pool.granted record")
        if (a.step, a.layer) not in routes:
            raise CostFitError(f"{path}: pool.acquire (step {a.step}, layer {a.layer}) has no trace.route record")
        if key not in part_tokens:
            _parts_of(routes[(a.step, a.layer)], k, header.capacities, part_tokens, acquired[(a.step, a.layer)])
        wait = g.t - a.t if g.misses else 0.0
        if g.misses and a.layer in nbytes:
            waits.append((wait, g.misses, nbytes[a.layer]))
        gap = nxt.t - a.t - wait
        live_s += nxt.t - a.t
        rows.append((float(part_tokens[key]), float(nxt.step != a.step), float(g.misses)))
        layers.append(a.layer)
        gaps.append(gap)
    x = np.array(rows)
    y = np.array(gaps)
    layer_of = np.array(layers)
    # A step boundary also holds whatever the caller did between generate calls (the log does
    # not mark them): a boundary 10x longer than the median one is such a pause, not a step.
    boundary = x[:, 1] > 0
    pauses = boundary & (y > PAUSE_FACTOR * np.median(y[boundary])) if boundary.any() else boundary
    return _Samples(x=x[~pauses], y=y[~pauses], layers=layer_of[~pauses], waits=waits, pauses=int(pauses.sum()),
                    steps=len({a.step for a in acquires}), live_s=live_s)


def _read_hop(waits: list[tuple[float, int, int]], device: DeviceProfile) -> tuple[float, float]:
    """Mean (and rms residual) over the parts with misses of their live wait less the time
    `device` takes to read their misses alone (whole rounds of `queue_depth` reads)."""
    extra = [w - -(-misses // device.queue_depth) * device.service_s(nbytes) for w, misses, nbytes in waits]
    hop = max(float(np.mean(extra)), 0.0)
    return hop, float(np.sqrt(np.mean((np.array(extra) - hop) ** 2)))


def _parts_of(route: Route, k: int, caps: dict[int, int], out: dict[tuple[int, int, int], float],
              acquires: list[Acquire]) -> None:
    owner = {e: a.part for a in acquires for e in a.experts}
    if len(acquires) > 1 and len(owner) == sum(len(a.experts) for a in acquires):  # disjoint: count pairs
        pairs = dict.fromkeys((a.part for a in acquires), 0)
        for e in route.experts:
            pairs[owner[e]] += 1
        for part, n in pairs.items():
            out[(route.step, route.layer, part)] = n / k
        return
    ids = np.asarray(route.experts, dtype=np.int64).reshape(-1, k)
    cap = caps.get(route.layer, ids.size)
    for p, (lo, hi, _) in enumerate(plan_parts(ids, cap, layer=route.layer)):
        out[(route.step, route.layer, p)] = hi - lo


def save_cost(path: str | os.PathLike[str], fit: CostFit) -> None:
    """Replace `path` with `fit` as JSON atomically (temp file in the same directory, fsync, rename)."""
    save_versioned(path, fit)


def load_cost(path: str | os.PathLike[str]) -> CostFit:
    """The cost file at `path`; ConfigError naming the file when absent, corrupt or not a cost file."""
    fit = load_versioned(path, CostFit, kind=COST_KIND, version=COST_VERSION, error=ConfigError, what="cost file",
                         remedy="a cost file is written by `qnpipe trace fit-cost LOG -o FILE`")
    try:
        fit.cost.check()
    except ConfigError as e:
        raise ConfigError(f"{Path(path)}: {e}") from None
    return fit


__all__ = ["COST_KIND", "COST_VERSION", "CostFit", "CostFitError", "fit_cost", "load_cost", "save_cost"]
