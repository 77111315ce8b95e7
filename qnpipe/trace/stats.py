"""What a routing or event log says about routing: popularity skew, reuse, unions, predictability.

    stats = trace_stats("run.qtrace")       # a log of `qnpipe generate --trace` or `qnpipe trace import`
    print(describe(stats))

Reads the log's `trace.route` records (every other record is ignored) and, when it has them,
its `trace.request` records (imported logs: several requests back to back; a native log is one
request). The definitions are in docs/trace-tools.md; in short, per MoE layer:

- popularity over the (token, expert) assignments: the share of the top 10% of experts
  (`top10_share`), the entropy (bits, and over log2 of the expert count), the Gini coefficient;
- `union_*`: distinct experts per layer-step;
- `reuse_*`: for each expert of a layer-step, the distinct other experts the layer used in the
  steps strictly between that expert's previous use and this one (a step-level stack distance: an
  LRU cache of d slots or fewer has evicted it; one of more slots that holds a step's experts
  together, as the pool does, may still have, by up to the step's union - 1 step-mates served
  after it: the exact hit rates are `qnpipe replay LOG --mrc`'s), over the log in order; `cold` when it is the first use; `reuse_counts` is the exact
  histogram (index d: the reuses at distance d), `reuse_hist` the same binned;
- `prev_token_hit`: of a token's top-k, the share its previous token (same request) also chose;

and per pair of consecutive recorded layers, `hit_at_k`: a transition table counted on the first
half of the tokens predicts the next layer's top-k of the second half, beside the popularity
baseline (`popular_hit_at_k`); and `total`, the same over all layers together (definitions in
docs/trace-tools.md). Pure numpy: no trio, no clock.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np

from qnpipe.errors import TraceSchemaError
from qnpipe.io.files import check_regular
from qnpipe.trace.format import ModelShape, RequestStart, Route, read


class LayerStats(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    layer_steps: int  # steps that routed at this layer
    tokens: int
    top10_share: float  # share of assignments that went to the most used ceil(10%) of experts
    entropy_bits: float
    entropy_norm: float  # entropy / log2(num_experts): 1 = uniform
    gini: float  # over all num_experts experts, unused ones included: 0 = uniform
    unused: int  # experts never chosen
    union_mean: float
    union_max: int
    tokens_per_step: float
    reuse_cold: int  # first uses
    reuse_median: float  # of the warm reuses (-1 when none)
    reuse_hist: dict[str, int]  # stack distance buckets "0", "1", "2-3", "4-7", ... -> warm reuses
    reuse_counts: list[int]  # exact: [d] = warm reuses at stack distance d, up to the largest seen
    prev_token_hit: float  # -1 when no token has a previous one


class TotalStats(msgspec.Struct, frozen=True, kw_only=True):
    """The summary row: counts summed over the layers, shares pooled over them, popularity averaged."""

    layers: int
    layer_steps: int  # summed over the layers
    tokens: int  # (token, layer) routes
    top10_share: float  # popularity is per layer (expert 3 of one layer is not expert 3 of another): means
    entropy_norm: float
    gini: float
    unused: int  # (layer, expert) pairs never chosen
    union_mean: float  # over every layer-step
    union_max: int
    reuse_cold: int
    reuse_median: float  # of every layer's warm reuses together (-1 when none)
    reuse_hist: dict[str, int]
    reuse_counts: list[int]  # the layers' exact histograms summed
    prev_token_hit: float  # pooled over every layer's token pairs (-1 when none)


class CrossLayerStats(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    next_layer: int
    train_tokens: int
    test_tokens: int
    hit_at_k: float  # transition table (first half) predicting next_layer's top-k (second half); -1 = no test
    popular_hit_at_k: float  # the first half's most popular top-k of next_layer, same test tokens


class TraceStats(msgspec.Struct, frozen=True, kw_only=True):
    log: str
    model: ModelShape
    requests: int
    steps: int
    tokens: int  # per step, the most tokens any layer routed
    layers: list[LayerStats]
    total: TotalStats
    cross_layer: list[CrossLayerStats]


# The cross-layer table is experts x experts counts (134 MB at this bound; real models have up to 512).
MAX_EXPERTS = 4096


def trace_stats(path: str | Path) -> TraceStats:
    """The statistics of a log's routes (TraceSchemaError when it has none or no model shape)."""
    check_regular(path, error=TraceSchemaError)  # a FIFO would block the read, a device never end it
    header, records = read(path)
    shape = header.model
    if shape is None:
        raise TraceSchemaError(f"{path}: record 0 (header) has no model shape")
    k, n_exp = shape.top_k, shape.num_experts
    if not 1 <= n_exp <= MAX_EXPERTS:
        raise TraceSchemaError(f"{path}: record 0 (header): a model of {n_exp} experts per layer: trace stats "
                               f"reads 1..{MAX_EXPERTS} (its cross-layer table is experts x experts)")
    if not 1 <= k <= n_exp:
        raise TraceSchemaError(f"{path}: record 0 (header): top_k={k}: want 1..{n_exp} (the model's experts)")
    firsts = {r.first_step for r in records if isinstance(r, RequestStart)}
    steps: dict[int, dict[int, np.ndarray]] = {}
    for n, r in enumerate(records, start=1):
        if not isinstance(r, Route):
            continue
        if r.top_k != k or not r.experts or len(r.experts) % k or not all(0 <= e < n_exp for e in r.experts):
            raise TraceSchemaError(f"{path}: record {n} (trace.route step {r.step}): {len(r.experts)} expert ids "
                                   f"at top_k={r.top_k} do not fit the model (top_k={k}, {n_exp} experts)")
        steps.setdefault(r.step, {})[r.layer] = np.asarray(r.experts, dtype=np.int64).reshape(-1, k)
    if not steps:
        raise TraceSchemaError(f"{path}: no trace.route records")
    order = sorted(steps)
    request_of = np.cumsum([s in firsts for s in order])  # request index per step (0 before any trace.request)
    layers = sorted({layer for s in steps.values() for layer in s})
    done = [_layer(layer, [(i, steps[s][layer]) for i, s in enumerate(order) if layer in steps[s]],
                   request_of, n_exp, k) for layer in layers]
    per_layer = [x for x, _ in done]
    cross = [_cross(a, b, [(steps[s][a], steps[s][b]) for s in order if a in steps[s] and b in steps[s]], n_exp, k)
             for a, b in zip(layers, layers[1:], strict=False)]
    return TraceStats(log=str(path), model=shape, requests=max(len(firsts), 1), steps=len(order),
                      tokens=sum(max(len(v) for v in steps[s].values()) for s in order),
                      layers=per_layer, total=_total(per_layer, [pairs for _, pairs in done]), cross_layer=cross)


def popularity(counts: np.ndarray) -> tuple[float, float, float, float]:
    """(top-10% share, entropy in bits, normalised entropy, Gini) of per-expert counts."""
    n, total = len(counts), float(counts.sum())
    if total == 0:
        return 0.0, 0.0, 0.0, 0.0
    c = np.sort(counts.astype(np.float64))
    top = float(c[-math.ceil(0.1 * n):].sum()) / total
    p = c[c > 0] / total
    h = float(-(p * np.log2(p)).sum())
    gini = float(2 * (np.arange(1, n + 1) * c).sum() / (n * total) - (n + 1) / n)
    return top, h, h / math.log2(n) if n > 1 else 0.0, gini


def bucket(d: int) -> str:
    """The reuse histogram's bucket of stack distance `d`: "0", "1", "2-3", "4-7", ..."""
    if d < 2:
        return str(d)
    lo = 1 << (d.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def stack_distances(sets: list[np.ndarray], n_exp: int) -> np.ndarray:
    """Per expert of each set, in order: distinct other experts used since its previous use (-1 = first use).

    The experts of one set are used together (a layer-step): they are not between each other's uses.
    """
    sizes = [len(s) for s in sets]
    step = np.repeat(np.arange(len(sets), dtype=np.int64), sizes)
    expert = np.concatenate(sets).astype(np.int64) if sets else np.zeros(0, dtype=np.int64)
    return step_distances(step, expert, len(sets), n_exp)


def step_distances(step: np.ndarray, expert: np.ndarray, steps: int, n_exp: int) -> np.ndarray:
    """`stack_distances` of the uses (`step[i]`, `expert[i]`): steps in 0..steps-1 ascending, experts distinct per step.

    The distance of a use at step j whose previous use was at step p is the number of experts
    whose last use before j is after p: one sort of the experts' last uses per step (a table of
    every step's last uses, sorted per row, measured 4x slower on 10,000 steps x 512 experts).
    """
    last = np.full(n_exp, -1, dtype=np.int64)
    out = np.empty(len(step), dtype=np.int64)
    bounds = np.searchsorted(step, np.arange(steps + 1))
    for j in range(steps):
        a, z = int(bounds[j]), int(bounds[j + 1])
        s = expert[a:z]
        used = np.sort(last[last >= 0])
        prev = last[s]
        d = len(used) - np.searchsorted(used, prev, side="right")  # experts whose last use is after prev
        out[a:z] = np.where(prev < 0, -1, d)
        last[s] = j
    return out


def reuse_counts(dist: np.ndarray) -> list[int]:
    """Warm stack distances counted exactly: [d] = how many are d (first uses, -1, left out)."""
    return np.bincount(dist[dist >= 0]).tolist()


def median_of_counts(counts: list[int] | np.ndarray) -> float:
    """The median of the values a histogram counts ([d] = how many are d), as np.median would give; -1 when empty."""
    c = np.cumsum(np.asarray(counts, dtype=np.int64))
    n = int(c[-1]) if len(c) else 0
    if n == 0:
        return -1.0
    lo, hi = np.searchsorted(c, [(n - 1) // 2, n // 2], side="right")
    return (int(lo) + int(hi)) / 2


def bin_counts(counts: list[int] | np.ndarray) -> dict[str, int]:
    """An exact histogram in the `bucket`s "0", "1", "2-3", ... (empty buckets left out)."""
    c = np.asarray(counts, dtype=np.int64)
    d = np.arange(len(c))
    idx = np.where(d == 0, 0, np.floor(np.log2(np.maximum(d, 1))).astype(np.int64) + 1)
    binned = np.bincount(idx, weights=c, minlength=1).astype(np.int64) if len(c) else np.zeros(0, np.int64)
    return {bucket(0 if i == 0 else 1 << (i - 1)): int(n) for i, n in enumerate(binned) if n}


def reuse_histogram(dist: np.ndarray) -> dict[str, int]:
    """Warm stack distances counted by `bucket` (first uses, -1, left out), buckets in increasing order."""
    warm = dist[dist >= 0]
    idx = np.where(warm == 0, 0, np.floor(np.log2(np.maximum(warm, 1))).astype(np.int64) + 1)
    counts = np.bincount(idx)
    return {bucket(0 if i == 0 else 1 << (i - 1)): int(c) for i, c in enumerate(counts) if c}


def _layer(layer: int, rows: list[tuple[int, np.ndarray]], request_of: np.ndarray, n_exp: int,
           k: int) -> tuple[LayerStats, tuple[int, int]]:
    """The layer's statistics, and (token pairs whose previous token chose an expert again, token pairs)."""
    ids = np.concatenate([r for _, r in rows])
    counts = np.bincount(ids.reshape(-1), minlength=n_exp)
    top, h, hn, gini = popularity(counts)
    sizes = np.asarray([r.size for _, r in rows], dtype=np.int64)
    # each layer-step's distinct experts, as (step, expert) sorted: key = step * n_exp + expert
    key = np.unique(np.repeat(np.arange(len(rows), dtype=np.int64), sizes) * n_exp + ids.reshape(-1))
    step, expert = key // n_exp, key % n_exp
    unions = np.bincount(step, minlength=len(rows))
    dist = step_distances(step, expert, len(rows), n_exp)
    exact = reuse_counts(dist)
    by_request: dict[int, list[np.ndarray]] = {}
    for i, r in rows:
        by_request.setdefault(int(request_of[i]), []).append(r)
    hits = pairs = 0
    for seqs in by_request.values():  # consecutive tokens within one request
        t = np.concatenate(seqs)
        hits += int((t[:-1, :, None] == t[1:, None, :]).sum())  # a token's ids are distinct: = overlaps
        pairs += len(t) - 1
    stats = LayerStats(layer=layer, layer_steps=len(rows), tokens=len(ids), top10_share=top, entropy_bits=h,
                       entropy_norm=hn, gini=gini, unused=int((counts == 0).sum()),
                       union_mean=float(unions.mean()), union_max=int(unions.max()),
                       tokens_per_step=len(ids) / len(rows), reuse_cold=int((dist < 0).sum()),
                       reuse_median=median_of_counts(exact), reuse_hist=bin_counts(exact), reuse_counts=exact,
                       prev_token_hit=hits / (pairs * k) if pairs else -1.0)
    return stats, (hits, pairs * k)


def _total(layers: list[LayerStats], pairs: list[tuple[int, int]]) -> TotalStats:
    width = max(len(x.reuse_counts) for x in layers)
    counts = np.zeros(width, dtype=np.int64)
    for x in layers:
        counts[:len(x.reuse_counts)] += np.asarray(x.reuse_counts, dtype=np.int64)  # [] alone would be float64
    exact = counts.tolist()
    hits, tries = sum(h for h, _ in pairs), sum(t for _, t in pairs)
    steps = sum(x.layer_steps for x in layers)
    return TotalStats(layers=len(layers), layer_steps=steps, tokens=sum(x.tokens for x in layers),
                      top10_share=float(np.mean([x.top10_share for x in layers])),
                      entropy_norm=float(np.mean([x.entropy_norm for x in layers])),
                      gini=float(np.mean([x.gini for x in layers])), unused=sum(x.unused for x in layers),
                      union_mean=sum(x.union_mean * x.layer_steps for x in layers) / steps,
                      union_max=max(x.union_max for x in layers), reuse_cold=sum(x.reuse_cold for x in layers),
                      reuse_median=median_of_counts(exact), reuse_hist=bin_counts(exact), reuse_counts=exact,
                      prev_token_hit=hits / tries if tries else -1.0)


def _cross(a: int, b: int, pairs: list[tuple[np.ndarray, np.ndarray]], n_exp: int, k: int) -> CrossLayerStats:
    aligned = [(x, y) for x, y in pairs if len(x) == len(y)]  # a layer that lost tokens cannot be aligned
    src = np.concatenate([x for x, _ in aligned]) if aligned else np.zeros((0, k), np.int64)
    dst = np.concatenate([y for _, y in aligned]) if aligned else np.zeros((0, k), np.int64)
    half = len(src) // 2
    table = np.zeros((n_exp, n_exp), dtype=np.int64)
    np.add.at(table, (np.repeat(src[:half], k, axis=1).reshape(-1), np.tile(dst[:half], (1, k)).reshape(-1)), 1)
    pop = np.bincount(dst[:half].reshape(-1), minlength=n_exp)
    rank = np.empty(n_exp, dtype=np.int64)
    rank[np.lexsort((np.arange(n_exp), -pop))] = np.arange(n_exp)  # ties: the more popular, then the lower id
    hits = base = 0
    popular = np.argsort(rank)[:k]
    chunk = max(1, (1 << 22) // (k * n_exp))  # the scores are [tokens, k, experts] before the sum: <= 32 MB
    for lo in range(half, len(src), chunk):
        test_src, test_dst = src[lo:lo + chunk], dst[lo:lo + chunk]
        score = table[test_src].sum(axis=1)  # [tokens, experts]: co-occurrence counts from the token's experts
        guess = np.argsort(-score * n_exp + rank, axis=1, kind="stable")[:, :k]
        hits += int((guess[:, :, None] == test_dst[:, None, :]).sum())
        base += int((popular[None, :, None] == test_dst[:, None, :]).sum())
    test = len(src) - half
    return CrossLayerStats(layer=a, next_layer=b, train_tokens=half, test_tokens=test,
                           hit_at_k=hits / (test * k) if test else -1.0,
                           popular_hit_at_k=base / (test * k) if test else -1.0)


def describe(s: TraceStats) -> str:
    """The statistics as tables for a terminal: a row per layer, the `all` row, the reuse histogram, cross-layer."""
    m, t = s.model, s.total
    lines = [f"{s.log}: {s.requests} request(s), {s.steps} steps, {s.tokens} tokens; {m.num_experts} experts, "
             f"top-{m.top_k}",
             f"  {'layer':>5} {'tokens':>7} {'top10%':>6} {'H/Hmax':>6} {'gini':>5} {'unused':>6} {'union':>6} "
             f"{'reuse p50':>9} {'cold':>5} {'prev-tok':>8}"]
    lines += [f"  {x.layer:>5} {x.tokens:>7} {x.top10_share:>6.3f} {x.entropy_norm:>6.3f} {x.gini:>5.3f} "
              f"{x.unused:>6} {x.union_mean:>6.2f} {x.reuse_median:>9.1f} {x.reuse_cold:>5} {x.prev_token_hit:>8.3f}"
              for x in s.layers]
    lines.append(f"  {'all':>5} {t.tokens:>7} {t.top10_share:>6.3f} {t.entropy_norm:>6.3f} {t.gini:>5.3f} "
                 f"{t.unused:>6} {t.union_mean:>6.2f} {t.reuse_median:>9.1f} {t.reuse_cold:>5} "
                 f"{t.prev_token_hit:>8.3f}")
    lines += _reuse_table(t)
    if s.cross_layer:
        lines.append(f"  cross-layer hit@{m.top_k} (table from the first half, tested on the second):")
        lines += [f"    {x.layer:>3} -> {x.next_layer:<3} table {x.hit_at_k:.3f}  popular {x.popular_hit_at_k:.3f}  "
                  f"({x.test_tokens} tokens)" for x in s.cross_layer]
    return "\n".join(lines)


def _reuse_table(t: TotalStats) -> list[str]:
    warm = sum(t.reuse_counts)
    if not warm:
        return [f"  reuse distance: no expert used twice ({t.reuse_cold} first uses)"]
    lines = [f"  reuse distance, all layers ({warm} reuses, {t.reuse_cold} first uses; exact counts per distance "
             "and layer: --json reuse_counts):",
             "    (cum at distance < c: at most this share of reuses hit in an LRU of c slots per layer; a step's "
             "experts held together hit fewer: `qnpipe replay LOG --mrc` gives the exact LRU hit rate)",
             f"    {'distance':>9} {'reuses':>9} {'share':>6} {'<= cum':>6}"]
    done = 0
    top = len(t.reuse_counts) - 1
    for lo in [0, 1, *(1 << i for i in range(1, top.bit_length()))] if top else [0]:
        name = bucket(lo)
        n = t.reuse_hist.get(name, 0)  # empty buckets shown too: a gap in the distances is part of the picture
        done += n
        lines.append(f"    {name:>9} {n:>9} {n / warm:>6.3f} {done / warm:>6.3f}")
    return lines


def to_json(s: TraceStats) -> bytes:
    return msgspec.json.encode(s)


__all__ = ["CrossLayerStats", "LayerStats", "TotalStats", "TraceStats", "bin_counts", "bucket", "describe",
           "median_of_counts", "popularity", "reuse_counts", "reuse_histogram", "stack_distances", "step_distances",
           "to_json", "trace_stats"]
