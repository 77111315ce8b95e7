"""Synthetic routing logs: seeded, at any shape, with tunable popularity, locality and cross-layer correlation.

    path = write_synth("synth.qtrace", SynthSpec(layers=48, experts=512, top_k=10, tokens=1000, seed=1,
                                                 locality=0.3, cross_layer=0.5, popularity="zipf:1.1"))

Every step is one token (a decode step). Each of its `top_k` experts at a layer is chosen,
in this order of preference:

- with probability `locality`, the expert the previous token put in the same position at
  this layer (temporal locality: shorter reuse distances), or with `reuse_depth` D > 1 the
  expert of the token d back, d uniform in 1..D (reuse distances spread over D tokens);
- else with probability `cross_layer`, the fixed partner (a seeded permutation per layer)
  of the expert this token put in that position at the previous layer (cross-layer
  correlation: a transition table learns it);
- else (or when that expert is already chosen) a draw from the layer's popularity:
  a table's row (`popularity="FILE"`, e.g. the Qwen3-30B-A3B CSVs of
  /work/shared/traces/raw/SOURCES.md §5), Zipf (`"zipf:a"`, ranks shuffled per layer) or uniform.

The output is a routing log (docs/trace-format.md, `contents = "routes"`): the header's
model is the synthetic shape (every layer a MoE layer, or the given `moe_layers`), `t` is 0 throughout, and the same
spec always gives the same bytes (one `numpy.random.Generator` drawn in a fixed order).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from qnpipe.errors import ConfigError, TraceSchemaError
from qnpipe.io.files import SMALL_CAP, read_text_capped
from qnpipe.trace import SCHEMA_VERSION, Header, ModelShape, Route, TraceWriter

# Bounds on a spec, checked before anything is allocated. Each is far above a real model (512 experts,
# 94 layers, top-10 at most today). The draws are made up front in one fixed order (the same spec gives the
# same bytes), about 120 bytes per (token, layer, top_k) choice at the peak: 10^7 choices take ~1.2 GB and
# ~15 s; the [layers, experts] tables (popularity, its cdf, the partners) 8 bytes per entry each.
LIMITS = {"layers": 4096, "experts": 1 << 16, "top_k": 1024, "tokens": 10**7, "reuse_depth": 4096}
MAX_CHOICES = 10**7  # tokens x layers x top_k
MAX_TABLE = 1 << 24  # layers x experts
MAX_SEED = 2**64 - 1


class SynthSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What `synth` makes: the shape, the seed and the three knobs (see the module doc)."""

    layers: int = 48
    experts: int = 512
    top_k: int = 10
    tokens: int = 1000
    seed: int = 0
    locality: float = 0.0  # P(reuse the previous token's expert in the same position)
    cross_layer: float = 0.0  # P(the partner of the previous layer's expert), when not reused
    popularity: str = "uniform"  # "uniform", "zipf:A" or a CSV table's path
    reuse_depth: int = 1  # a reused expert is the one of the token d back, d uniform in 1..reuse_depth

    def digest(self) -> str:
        """The log's fingerprint: of every field, `reuse_depth` only when not 1 (older specs keep theirs)."""
        fields = msgspec.to_builtins(self)
        if self.reuse_depth == 1:
            del fields["reuse_depth"]
        return hashlib.sha256(b"synth:" + msgspec.json.encode(fields)).hexdigest()

    def check(self) -> SynthSpec:
        """Self, or ConfigError naming the bad field."""
        for name, most in LIMITS.items():
            v = getattr(self, name)
            if not 1 <= v <= most:
                raise ConfigError(f"synth {name}={v}: must be in [1, {most}]")
        if self.top_k > self.experts:
            raise ConfigError(f"synth top_k={self.top_k}: more than the {self.experts} experts")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"synth seed={self.seed}: must be in [0, 2**64 - 1]")
        if (n := self.tokens * self.layers * self.top_k) > MAX_CHOICES:
            raise ConfigError(f"synth tokens x layers x top_k = {self.tokens} x {self.layers} x {self.top_k} = {n}: "
                              f"at most {MAX_CHOICES} choices are drawn (~120 bytes each, up front)")
        if (n := self.layers * self.experts) > MAX_TABLE:
            raise ConfigError(f"synth layers x experts = {self.layers} x {self.experts} = {n}: at most {MAX_TABLE}")
        for name in ("locality", "cross_layer"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"synth {name}={v}: must be in [0, 1]")
        return self


def popularity(spec: SynthSpec, rng: np.random.Generator) -> np.ndarray:
    """Per-layer routing probabilities `[layers, experts]` (rows sum to 1) for `spec.popularity`."""
    src = spec.popularity
    if src == "uniform":
        return np.full((spec.layers, spec.experts), 1.0 / spec.experts)
    if src.startswith("zipf:"):
        try:
            a = float(src[5:])
        except ValueError:
            a = -1.0
        if not a >= 0:
            raise ConfigError(f"synth popularity={src!r}: zipf:A needs a number A >= 0")
        by_rank = 1.0 / np.arange(1, spec.experts + 1) ** a
        rows = np.stack([by_rank[rng.permutation(spec.experts)] for _ in range(spec.layers)])
    else:
        table = read_popularity_table(src)
        # The table's layers and experts stretched over the shape (each entry covers a block).
        li = np.arange(spec.layers) * len(table) // spec.layers
        ei = np.arange(spec.experts) * table.shape[1] // spec.experts
        rows = table[li][:, ei]
    rows = np.maximum(rows, 1e-12)
    return rows / rows.sum(axis=1, keepdims=True)


def read_popularity_table(path: str | Path) -> np.ndarray:
    """A CSV of per-layer expert popularity `[layers, experts]`: a `Layer` column and `Expert_<i>` columns.

    Rows of the same layer (e.g. one per language) are averaged. TraceSchemaError names the
    file and the row of anything malformed.
    """
    p = Path(path)
    text = read_text_capped(p, SMALL_CAP, error=TraceSchemaError)
    rows = list(csv.reader(text.splitlines()))
    if not rows or "Layer" not in rows[0]:
        raise TraceSchemaError(f"{p}: row 1 (header): no 'Layer' column: not a popularity table")
    head = rows[0]
    cols = [i for i, name in enumerate(head) if name.startswith("Expert_")]
    if not cols:
        raise TraceSchemaError(f"{p}: row 1 (header): no Expert_<i> columns")
    at = head.index("Layer")
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for n, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        try:
            layer = int(row[at])
            vals = np.array([float(row[i]) for i in cols])
        except (ValueError, IndexError):
            raise TraceSchemaError(f"{p}: row {n}: not a layer number and {len(cols)} numbers") from None
        if layer < 0 or not np.all(np.isfinite(vals)) or np.any(vals < 0):
            raise TraceSchemaError(f"{p}: row {n}: layer {layer}: values must be finite and >= 0")
        sums[layer] = sums.get(layer, 0) + vals
        counts[layer] = counts.get(layer, 0) + 1
    if sorted(sums) != list(range(len(sums))) or not sums:
        raise TraceSchemaError(f"{p}: layers {sorted(sums)}: expected 0..N-1, each at least once")
    return np.stack([sums[layer] / counts[layer] for layer in range(len(sums))])


def synth(spec: SynthSpec) -> list[list[tuple[int, ...]]]:
    """The routes: `out[token][layer]` = that token's `top_k` distinct expert ids at that layer."""
    spec.check()
    rng = np.random.default_rng(spec.seed)
    pop = popularity(spec, rng)
    partner = np.stack([rng.permutation(spec.experts) for _ in range(spec.layers)])
    n, k, e_count = spec.tokens, spec.top_k, spec.experts
    # Drawn up front in one fixed order: the knobs' coins, and popularity draws with room for rejects.
    coins = rng.random((n, spec.layers, k, 2))
    extra = 2 * k
    cdf = np.cumsum(pop, axis=1)
    cdf[:, -1] = 1.0
    u = rng.random((spec.layers, n * (k + extra)))
    draws = np.stack([np.searchsorted(cdf[layer], u[layer], side="right") for layer in range(spec.layers)])
    draws = np.minimum(draws, e_count - 1).reshape(spec.layers, n, k + extra)
    # Drawn last, and only for a depth above 1: a spec of depth 1 gives the bytes it always gave.
    back = rng.integers(1, spec.reuse_depth + 1, size=(n, spec.layers, k)).tolist() if spec.reuse_depth > 1 else None
    history: list[list[list[int]]] = []
    reuse = (coins[..., 0] < spec.locality).tolist()
    cross = (coins[..., 1] < spec.cross_layer).tolist()
    partner_l = partner.tolist()
    out: list[list[tuple[int, ...]]] = []
    prev: list[list[int]] | None = None
    for t in range(n):
        row: list[tuple[int, ...]] = []
        below: list[int] | None = None
        for layer in range(spec.layers):
            chosen: list[int] = []
            seen: set[int] = set()
            pool = draws[layer, t].tolist()
            pi = 0
            for j in range(k):
                e = -1
                if back is not None and reuse[t][layer][j] and t:
                    cand = history[max(t - back[t][layer][j], 0)][layer][j]
                    e = cand if cand not in seen else -1
                    if e < 0 and below is not None and cross[t][layer][j] and partner_l[layer][below[j]] not in seen:
                        e = partner_l[layer][below[j]]
                elif prev is not None and reuse[t][layer][j] and prev[layer][j] not in seen:
                    e = prev[layer][j]
                elif below is not None and cross[t][layer][j] and partner_l[layer][below[j]] not in seen:
                    e = partner_l[layer][below[j]]
                while e < 0:
                    if pi < len(pool):
                        cand = pool[pi]
                        pi += 1
                    else:  # rejects used up (a very skewed table): the least id not chosen yet
                        cand = next(x for x in range(e_count) if x not in seen)
                    if cand not in seen:
                        e = cand
                chosen.append(e)
                seen.add(e)
            row.append(tuple(chosen))
            below = chosen
        out.append(row)
        prev = [list(r) for r in row]
        if back is not None:
            history.append(prev)
    return out


def write_synth(path: str | Path, spec: SynthSpec, *, moe_layers: Sequence[int] | None = None,
                num_layers: int | None = None) -> Path:
    """Write the routing log of `spec` to `path` (temp name, then renamed); returns the path.

    `moe_layers`: the layer ids the spec's layers are written at, in order (a model whose dense layers
    route nothing: its log names its own MoE layers), of `num_layers` in all; default 0..spec.layers-1."""
    spec.check()  # before anything sized by it is built
    layers = tuple(range(spec.layers)) if moe_layers is None else tuple(int(x) for x in moe_layers)
    total = spec.layers if num_layers is None else num_layers
    if len(layers) != spec.layers or list(layers) != sorted(set(layers)) or (layers and not 0 <= layers[0]) \
            or (layers and layers[-1] >= total):
        raise ConfigError(f"synth moe_layers={list(layers)}: must be {spec.layers} distinct increasing layer ids "
                          f"in [0, {total})")
    routes = synth(spec)
    shape = ModelShape(num_layers=total, moe_layers=layers, num_experts=spec.experts, top_k=spec.top_k,
                       hidden_size=0)
    digest = spec.digest()
    header = Header(schema_version=SCHEMA_VERSION, fingerprint=digest, model=shape, clock_start_t=0.0,
                    wall_start_unix_s=0.0, contents="routes")
    w = TraceWriter(path, header)
    try:
        seq = 0
        for t, row in enumerate(routes, start=1):
            for layer, experts in zip(layers, row, strict=True):
                seq += 1
                w.write(Route(t=0.0, seq=seq, step=t, layer=layer, top_k=spec.top_k, experts=experts))
        w.close(0, 0.0)
    except BaseException:
        w.abandon()
        w.partial.unlink(missing_ok=True)
        raise
    return Path(path)


__all__ = ["SynthSpec", "popularity", "read_popularity_table", "synth", "write_synth"]
