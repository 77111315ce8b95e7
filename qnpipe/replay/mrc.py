"""Miss-ratio curves: each layer's demand hit rate at every capacity, for LRU and Belady, in one pass (pure).

    curves = miss_ratio_curves("run.qtrace")   # or mrc(log.steps, log.shape) of a load_log(...)
    curves.rows()                              # [{"policy", "layer", "capacity", "hits", "requests", "hit_rate"}]

The pool's own semantics, as a demand-only replay (`qnpipe replay`, no prediction) counts them:
a layer-step's experts are acquired together and held together, so an expert of the step is
never evicted to make room for another of the same step; capacities run from the model's
top-k (the pool refuses fewer slots than a token's experts: qnpipe.policy.build.layer_capacities)
to the expert count.

- **Belady** (farthest next use, ties to the higher id: qnpipe.replay.belady) keeps the inclusion
  property with held-together requests: the cache at capacity C is the top C of one stack (Mattson
  et al.'s OPT stack, next use as the priority). A request R moves to the top; below it, slot C of
  the new stack takes the best (nearest next use) of the old stack's non-R entries above C that the
  new stack has not taken yet: a buffer of the displaced entries carried down until the deepest
  entry of R was passed. A hit at C is an old stack position below C.
- **LRU** does not keep it. The pool touches a step's hits first, then loads its misses, so within
  one step the recency order of its experts depends on which were hits, which depends on the
  capacity (tests/replay/test_mrc.py shows a log where C slots hold an expert C+1 slots do not).
  Exact all the same: the cache at C is the C most recent experts by (step, missed at C, id). For an
  access of expert e last used at step t, with D distinct experts used since and q of t's other
  experts not used since, it is a miss at C <= D, a hit at C > D + q, and in between a hit iff
  fewer than C - D of those q rank above e at C: each needs its own miss status at t at C, which
  its access's record (D, D + q, a bit per capacity between) gives.

Both passes run as C loops (cextensions/mrc_opt.c: `qnpipe.replay._mrc_opt`, optional, built at install,
loaded with ctypes) when it was built, else in numpy, a step of all layers at a time: the same
numbers (tests/replay/test_mrc.py runs both), the numpy ones tens of times slower.

A multi-token step whose experts do not fit C slots runs in parts (qnpipe.policy.parts.Splitter, as
forward.parts splits it: `by_expert`), so the requests themselves depend on C below a layer's largest
step union: those capacities are replayed one by one (the slot table for LRU, qnpipe.replay.belady for
Belady). Logs of one-token steps never need that.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import importlib.machinery
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from qnpipe.policy.parts import Splitter
from qnpipe.replay.belady import belady_hits
from qnpipe.replay.log import load_log
from qnpipe.trace import ModelShape

POLICIES = ("lru", "belady")
ALL = "all"  # the layer column of the total over every layer the log routes
MAX_BAND = 62  # one int64 of band bits per access: steps of at most 63 distinct experts go one pass

_NEVER = 1 << 40


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    """One policy at one layer (or `layer=ALL`): `hits[i]` and `requests[i]` at `capacities[i]`."""

    policy: str
    layer: int | str
    capacities: list[int]
    hits: list[int]
    requests: list[int]

    def hit_rate(self) -> list[float]:
        return [h / r if r else 0.0 for h, r in zip(self.hits, self.requests, strict=True)]


class MrcResult(msgspec.Struct, frozen=True, kw_only=True):
    """Every layer's curves and the totals: capacities `min_capacity..num_experts` slots per layer."""

    log: str
    shape: ModelShape
    min_capacity: int
    curves: list[Curve]

    def curve(self, policy: str, layer: int | str = ALL) -> Curve:
        for c in self.curves:
            if c.policy == policy and c.layer == layer:
                return c
        raise KeyError(f"no {policy} curve of layer {layer}")

    def rows(self) -> list[dict[str, Any]]:
        """Long format: one dict per (policy, layer, capacity) with hits, requests and hit_rate."""
        return [{"policy": c.policy, "layer": c.layer, "capacity": cap, "hits": h, "requests": r,
                 "hit_rate": h / r if r else 0.0}
                for c in self.curves for cap, h, r in zip(c.capacities, c.hits, c.requests, strict=True)]


def layer_requests(steps: Sequence[Sequence[tuple[int, tuple[int, ...]]]],
                   layers: Sequence[int]) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """Per layer, (step index, the step's distinct experts ascending) of each step that routes it."""
    out: dict[int, list[tuple[int, tuple[int, ...]]]] = {layer: [] for layer in layers}
    for s, step in enumerate(steps):
        for layer, experts in step:
            out[layer].append((s, tuple(sorted(set(experts)))))
    return out


# ---------------------------------------------------------------------------------------------- LRU


def lru_one_pass(reqs: np.ndarray, num_experts: int, *, native: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Hits of the pool's LRU at every capacity, per layer: `reqs [S, L, W]` (experts, -1 padding; a row
    of -1 = the layer has no request at that step; each request of distinct experts).

    Returns (hits [L, E + 1] indexed by capacity, requests [L]); valid at capacities >= every request's size.
    `native`: the C loop (`qnpipe.replay._mrc_opt`, the same algorithm a layer at a time; None = when it was
    built) or this one, all layers a step at a time in numpy."""
    n_steps, n_layers, w = reqs.shape
    e_count = num_experts
    band = max(w - 1, 1)  # the capacities (D, D + q] where an access's hit depends on its step's mates
    if band > MAX_BAND:
        raise ValueError(f"a request of {w} experts: the one-pass LRU takes at most {MAX_BAND + 1}")
    lib = _native_for(native)
    if lib is not None:
        req = np.ascontiguousarray(reqs, dtype=np.int64)
        above = np.zeros((n_layers, e_count + 2), dtype=np.int64)
        between = np.zeros((n_layers, e_count + 2), dtype=np.int64)
        _native_ok(lib.lru(req.ctypes.data, n_steps, n_layers, w, e_count, above.ctypes.data, between.ctypes.data),
                   e_count)
        hits = np.cumsum(above, axis=1) + between
        return hits[:, :e_count + 1], (req >= 0).sum(axis=(0, 2))
    # Flat [layer * E + expert]: each expert's last access (its step) and that access's record.
    size = n_layers * e_count
    last = np.full(size, -1, dtype=np.int64)
    lo = np.full(size, e_count, dtype=np.int64)  # a miss at C <= lo ...
    hi = np.full(size, e_count, dtype=np.int64)  # ... a hit at C > hi ...
    bits = np.zeros(size, dtype=np.int64)  # ... between, bit C - lo - 1 says
    li = np.arange(n_layers)[:, None]
    base = li * e_count
    base3 = base[:, :, None]
    j = np.arange(1, band + 1, dtype=np.int64)  # C - D over the band
    shifts = j - 1
    full = np.int64((1 << band) - 1)
    nbytes = (band + 7) // 8
    off = li * (n_steps + 2)
    rec_d: list[np.ndarray] = []
    rec_q: list[np.ndarray] = []
    rec_bits: list[np.ndarray] = []
    rec_seen: list[np.ndarray] = []
    requests = np.zeros(n_layers, dtype=np.int64)
    padded = bool((reqs < 0).any())
    for s in range(n_steps):
        r = reqs[s]
        valid = r >= 0
        whole = bool(valid.all())
        if not whole and not valid.any():
            continue
        fe = base + (r if whole else np.where(valid, r, 0))
        t = last[fe]  # [L, W]
        seen = (t >= 0) if whole else valid & (t >= 0)
        # distinct experts used since: those whose last use is later, counted in each layer's sorted row
        ordered = (np.sort(last.reshape(n_layers, e_count), axis=1) + off).reshape(-1)
        d = e_count - (np.searchsorted(ordered, t + off, side="right") - base)
        mates = reqs[np.maximum(t, 0), li]  # [L, W, W]: the step t request of each expert's layer
        fm = base3 + np.maximum(mates, 0)
        alive = (last[fm] == t[:, :, None]) & (mates != r[:, :, None]) & seen[:, :, None]
        if padded:  # a mate slot of step t may be padding even when step s has none
            alive &= mates >= 0
        q = alive.sum(axis=2)
        # Bit j - 1 of each mask: at capacity d + j (the band of this access).
        miss_e = ~_hit_window(lo[fe], hi[fe], bits[fe], d, band)[:, :, None] & full
        miss_g = ~_hit_window(lo[fm], hi[fm], bits[fm], d[:, :, None], band) & full
        # A mate is newer at a capacity when it missed there and e hit, or both alike and its id is higher.
        newer = (miss_g & ~miss_e) | (~(miss_g ^ miss_e) & np.where(mates > r[:, :, None], full, 0))
        newer = np.where(alive, newer & full, 0)
        per_bit = np.unpackbits(newer.astype("<i8").view(np.uint8).reshape(*newer.shape, 8)[..., :nbytes],
                                axis=-1, bitorder="little")[..., :band]  # [L, W, W, B]
        rank = per_bit.sum(axis=2, dtype=np.int64)  # [L, W, B]
        hit_band = (j <= q[:, :, None]) & (rank < j)
        new_bits = np.where(seen, (hit_band << shifts).sum(axis=2), 0)
        top = d + q
        if whole:
            requests += w
            last[fe] = s
            lo[fe] = np.where(seen, d, e_count)
            hi[fe] = np.where(seen, top, e_count)
            bits[fe] = new_bits
        else:
            requests += valid.sum(axis=1)
            fv = fe[valid]
            last[fv] = s
            lo[fv] = np.where(seen, d, e_count)[valid]
            hi[fv] = np.where(seen, top, e_count)[valid]
            bits[fv] = new_bits[valid]
        rec_d.append(d)
        rec_q.append(q)
        rec_bits.append(new_bits)
        rec_seen.append(seen)
    # Every access counted at once: a hit at each capacity above d + q, and at d + j for each band bit j - 1.
    stride = e_count + 2
    hits = np.zeros((n_layers, stride), dtype=np.int64)
    if rec_d:
        dd, qq, bb, ss = (np.stack(x, axis=1) for x in (rec_d, rec_q, rec_bits, rec_seen))  # [L, steps, W]
        lay = np.broadcast_to(li[:, :, None], dd.shape)
        above = np.bincount((lay * stride + dd + qq + 1)[ss], minlength=n_layers * stride)
        some = bb != 0
        at, bb = (lay * stride + dd)[some], bb[some]
        between = np.zeros(n_layers * stride, dtype=np.int64)
        for jj in range(1, band + 1):
            between += np.bincount(at[(bb >> (jj - 1)) & 1 == 1] + jj, minlength=n_layers * stride)
        hits = np.cumsum(above.reshape(n_layers, stride), axis=1) + between.reshape(n_layers, stride)
    return hits[:, :e_count + 1], requests


def _hit_window(lo: np.ndarray, hi: np.ndarray, bits: np.ndarray, d: np.ndarray, band: int) -> np.ndarray:
    """Bit j - 1 set where the access recorded as (lo, hi, bits) hit at capacity d + j, j = 1..band."""
    full = np.int64((1 << band) - 1)
    above = full & ~((np.int64(1) << np.clip(hi - d, 0, band)) - 1)  # every capacity past hi
    shift = d - lo
    between = np.where(shift >= 0, bits >> np.clip(shift, 0, 63), bits << np.clip(-shift, 0, 63))
    return (above | between) & full


def lru_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Hits of the pool's LRU slot table over `requests` (each distinct experts held together) at `capacity`."""
    from qnpipe.policy.eviction import LRU
    from qnpipe.policy.slot_table import SlotTable

    table = SlotTable(0, capacity, LRU())
    hits = 0
    for r in requests:
        plan = table.acquire(r)
        for ld in plan.loads:
            table.loaded(ld.expert, ld.slot)
        table.release(r)
        hits += len(plan.hits)
    return hits


# ------------------------------------------------------------------------------------------- Belady


def belady_one_pass(requests: Sequence[Sequence[int]], num_experts: int, *, native: bool | None = None) -> np.ndarray:
    """Belady's hits at every capacity (index = capacity, 0..num_experts) of one layer's `requests`."""
    width = max((len(r) for r in requests), default=1)
    arr = np.full((len(requests), 1, width), -1, dtype=np.int64)
    for i, r in enumerate(requests):
        arr[i, 0, :len(r)] = r
    return belady_layers(arr, num_experts, native=native)[0]


def native_available() -> bool:
    """Whether the C loop `qnpipe.replay._mrc_opt` (cextensions/mrc_opt.c, built at install when a compiler is there) loaded."""
    return _native() is not None


@functools.cache
def _native() -> Any:
    """The C library's two functions (a namespace with `belady`, `lru`), or None when it was not built."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_mrc_opt{suffix}"
        if p.is_file():
            try:
                lib = ctypes.CDLL(str(p))
            except OSError:
                return None
            opt, lru = lib.qnpipe_belady_layers, lib.qnpipe_lru_layers
            opt.restype = lru.restype = ctypes.c_int
            opt.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p]
            lru.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p]
            return types.SimpleNamespace(belady=opt, lru=lru)
    return None


def _native_for(native: bool | None) -> Any:
    lib = _native() if native is not False else None
    if native and lib is None:
        raise RuntimeError("qnpipe.replay._mrc_opt was not built (no C compiler at install): use native=None or False")
    return lib


def _native_ok(code: int, num_experts: int) -> None:
    if code == -1:
        raise MemoryError("qnpipe.replay._mrc_opt: out of memory")
    if code == -3:
        raise ValueError(f"a request repeats an expert or names one outside 0..{num_experts - 1}")
    if code != 0:
        raise ValueError(f"qnpipe.replay._mrc_opt: refused the requests (code {code})")


def belady_layers(reqs: np.ndarray, num_experts: int, *, native: bool | None = None) -> np.ndarray:
    """Belady's hits at every capacity per layer by the OPT stack (module doc): `reqs [S, L, W]` as for
    `lru_one_pass`. Returns hits [L, E + 1] indexed by capacity, valid at capacities >= every request's size.

    `native`: the C loop (`qnpipe.replay._mrc_opt`, the same algorithm; None = when it was built) or this
    module's own: the stacks' bookkeeping in numpy over all layers at once, the carry a plain loop per
    layer over the few entries that can move (R's old slots, and entries worse than the buffer's first
    best: the buffer's best only gets worse as it carries)."""
    n_steps, n_layers, w = reqs.shape
    e_count = num_experts
    stride = e_count + 2
    lib = _native_for(native)
    if lib is not None:
        req = np.ascontiguousarray(reqs, dtype=np.int64)
        dist = np.zeros((n_layers, stride), dtype=np.int64)
        _native_ok(lib.belady(req.ctypes.data, n_steps, n_layers, w, e_count, dist.ctypes.data), e_count)
        return np.cumsum(dist, axis=1)[:, :e_count + 1]
    # Each access's priority: its step's next use of the expert (nearer = kept), ties evicting the higher id.
    ss, ll, ww = np.nonzero(reqs >= 0)
    who = ll * e_count + reqs[ss, ll, ww]
    order = np.lexsort((ss, who))
    nxt = np.full(len(order), _NEVER, dtype=np.int64)
    same = who[order][1:] == who[order][:-1]
    nxt[order[:-1][same]] = ss[order][1:][same]
    prio = np.zeros(reqs.shape, dtype=np.int64)
    prio[ss, ll, ww] = nxt * (e_count + 1) + reqs[ss, ll, ww]
    size = n_layers * e_count
    key = np.zeros(size, dtype=np.int64)  # flat [layer * E + expert]: the priority of its last access
    pos = np.full(size, -1, dtype=np.int64)  # its position in its layer's stack
    in_r = np.zeros(size, dtype=bool)
    stack = np.full((n_layers, e_count), -1, dtype=np.int64)
    depth = np.zeros(n_layers, dtype=np.int64)  # entries in each stack
    li = np.arange(n_layers)
    base = (li * e_count)[:, None]
    cols = np.arange(e_count)
    worst = np.iinfo(np.int64).max
    hit_at: list[np.ndarray] = []
    heappop, heapreplace, heapify = heapq.heappop, heapq.heapreplace, heapq.heapify
    for s in range(n_steps):
        r = reqs[s]
        valid = r >= 0
        rr = valid.sum(axis=1)
        if not rr.any():
            continue
        fe = base + np.maximum(r, 0)
        p = np.where(valid, pos[fe], -1)
        old = p >= 0
        hit_at.append((li[:, None] * stride + p + 1)[old])
        cold = rr - old.sum(axis=1)
        deep = np.where(cold > 0, depth - 1, p.max(axis=1))
        fv = fe[valid]
        in_r[fv] = True
        span = int(max(deep.max() + 1, w))
        st = stack[:, :span]
        present = st >= 0
        fst = base + np.maximum(st, 0)
        hole = in_r[fst] & present
        k = key[fst]
        head = present[:, :w] & ~hole[:, :w] & (cols[:w] < rr[:, None])
        best0 = np.where(head, k[:, :w], worst).min(axis=1)
        cand = (hole | (k > best0[:, None])) & (cols[:span] >= rr[:, None]) & (cols[:span] <= deep[:, None])
        rows, cc = np.nonzero(cand)
        bounds = np.searchsorted(rows, np.arange(n_layers + 1)).tolist()
        c_col, c_hole, c_key, c_item = cc.tolist(), hole[rows, cc].tolist(), k[rows, cc].tolist(), st[rows, cc].tolist()
        heads = np.nonzero(head)
        h_rows, h_key, h_item = heads[0].tolist(), k[:, :w][heads].tolist(), st[:, :w][heads].tolist()
        bufs: dict[int, list[tuple[int, int]]] = {}
        for lay, kk, x in zip(h_rows, h_key, h_item, strict=True):
            bufs.setdefault(lay, []).append((kk, x))
        w_n: list[int] = []  # per layer with a buffer, in `bufs` order: how many slots it rewrites
        w_col: list[int] = []
        w_item: list[int] = []
        put_col, put_item = w_col.append, w_item.append
        for lay, buf in bufs.items():
            heapify(buf)
            n0 = len(w_col)
            a, b = bounds[lay], bounds[lay + 1]
            for c, is_hole, kc, xc in zip(c_col[a:b], c_hole[a:b], c_key[a:b], c_item[a:b], strict=True):
                if is_hole:
                    put_item(heappop(buf)[1])
                elif kc > buf[0][0]:
                    put_item(heapreplace(buf, (kc, xc))[1])
                else:
                    continue
                put_col(c)
                if not buf:
                    break
            if buf:  # the old stack passed with experts new to it: what the buffer carries goes below, best first
                start = max(int(rr[lay]), int(depth[lay]))
                for j, (_, x) in enumerate(sorted(buf)):
                    put_col(start + j)
                    put_item(x)
            w_n.append(len(w_col) - n0)
        stack[:, :w][valid] = r[valid]  # a request's experts are left-aligned in their row: slots 0..rr-1
        pos[fv] = np.nonzero(valid)[1]
        if w_col:
            wr, wc, wi = np.repeat(np.fromiter(bufs, dtype=np.int64), w_n), np.array(w_col), np.array(w_item)
            stack[wr, wc] = wi
            pos[wr * e_count + wi] = wc
        depth += cold
        key[fv] = prio[s][valid]
        in_r[fv] = False
    dist = np.bincount(np.concatenate(hit_at) if hit_at else np.zeros(0, np.int64), minlength=n_layers * stride)
    return np.cumsum(dist[:n_layers * stride].reshape(n_layers, stride), axis=1)[:, :e_count + 1]


# ------------------------------------------------------------------------------------------- driver


def mrc(steps: Sequence[Sequence[tuple[int, tuple[int, ...]]]], shape: ModelShape, *,
        policies: Sequence[str] = POLICIES, log: str = "", native: bool | None = None,
        by_expert: bool = True) -> MrcResult:
    """The curves of a log's routes (`ReplayLog.steps`): every layer that routes, and their total over them.

    Capacities run from `shape.top_k` to `shape.num_experts`; a layer whose largest step needs more
    slots than a capacity replays that capacity on its own (module doc). `native`: the C loops or the
    numpy ones (None: C when built). `by_expert`: split steps as forward.parts=experts does, else tokens."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy {p!r}: unknown, known: {', '.join(POLICIES)}")
    k, e_count = shape.top_k, shape.num_experts
    caps = list(range(k, e_count + 1))
    # The one pass covers the capacities a layer's every step fits, as one padded array of the layers it takes:
    # LRU's band takes steps of up to MAX_BAND + 1 experts, Belady's stack any.
    built: dict[tuple[int, ...], np.ndarray] = {}
    dense = _dense(steps, shape)
    if dense is not None:  # one token per step at every layer: no dict per layer to go through
        per_layer: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        layers = list(shape.moe_layers)
        union = dict.fromkeys(layers, k)
        whole = dict.fromkeys(layers, len(steps) * k)
        built[tuple(layers)] = dense
    else:
        per_layer = layer_requests(steps, shape.moe_layers)
        layers = [layer for layer in shape.moe_layers if per_layer[layer]]
        union = {layer: max(len(ex) for _, ex in per_layer[layer]) for layer in layers}
        whole = {layer: sum(len(ex) for _, ex in per_layer[layer]) for layer in layers}

    def padded(of: list[int]) -> np.ndarray:
        if tuple(of) in built:
            return built[tuple(of)]
        width = max((union[x] for x in of), default=1)
        arr = np.full((len(steps), len(of), width), -1, dtype=np.int64)
        for i, layer in enumerate(of):
            rows = per_layer[layer]
            if len(rows) == len(steps) and all(len(ex) == width for _, ex in rows):  # every step, all full
                arr[:, i, :] = np.array([ex for _, ex in rows], dtype=np.int64)
                continue
            for s, ex in rows:
                arr[s, i, :len(ex)] = ex
        built[tuple(of)] = arr
        return arr

    curves: list[Curve] = []
    for policy in policies:
        fits = [layer for layer in layers if policy == "belady" or union[layer] - 1 <= MAX_BAND]
        h = (lru_one_pass(padded(fits), e_count, native=native)[0] if policy == "lru"
             else belady_layers(padded(fits), e_count, native=native))
        one = {layer: h[i].tolist() for i, layer in enumerate(fits)}  # hits by capacity
        own: list[Curve] = []
        for layer in layers:
            hl: list[int] = []
            nl: list[int] = []
            raw: list[tuple[int, ...]] | None = None
            for c in caps:
                if c >= union[layer] and layer in one:
                    hl.append(one[layer][c])
                    nl.append(whole[layer])
                    continue
                if raw is None:
                    raw = [experts for step in steps for ly, experts in step if ly == layer]
                split = Splitter(by_expert).parts  # one per capacity: a layer's parts depend on its previous split
                parts = [ex for experts in raw for _, _, ex in split(experts, k, c, layer)]
                hl.append(belady_hits(parts, c) if policy == "belady" else lru_hits(parts, c))
                nl.append(sum(map(len, parts)))
            own.append(Curve(policy=policy, layer=layer, capacities=caps, hits=hl, requests=nl))
        curves += own
        curves.append(Curve(policy=policy, layer=ALL, capacities=caps,
                            hits=[sum(c.hits[i] for c in own) for i in range(len(caps))],
                            requests=[sum(c.requests[i] for c in own) for i in range(len(caps))]))
    return MrcResult(log=log, shape=shape, min_capacity=k, curves=curves)


def _dense(steps: Sequence[Sequence[tuple[int, tuple[int, ...]]]], shape: ModelShape) -> np.ndarray | None:
    """The routes as [S, L, top_k] when every step routes every MoE layer (in order) with one token of
    distinct experts (a decode log: `qnpipe trace synth`'s), else None."""
    n_layers, k = len(shape.moe_layers), shape.top_k
    if not steps or any(len(step) != n_layers for step in steps):
        return None
    if any(tuple(ly for ly, _ in step) != tuple(shape.moe_layers) for step in steps):
        return None
    try:
        arr = np.array([[ex for _, ex in step] for step in steps], dtype=np.int64)
    except ValueError:  # ragged: steps of several tokens
        return None
    if arr.ndim != 3 or arr.shape[2] != k:
        return None
    ordered = np.sort(arr, axis=2)
    return None if (ordered[..., 1:] == ordered[..., :-1]).any() else arr


def miss_ratio_curves(path: str | Path, *, policies: Sequence[str] = POLICIES, native: bool | None = None,
                      by_expert: bool = True) -> MrcResult:
    """`mrc` of the log at `path` (qnpipe.replay.load_log checks it)."""
    log = load_log(path)
    return mrc(log.steps, log.shape, policies=policies, log=str(path), native=native, by_expert=by_expert)


__all__ = ["ALL", "POLICIES", "Curve", "MrcResult", "belady_layers", "belady_one_pass", "layer_requests", "lru_hits",
           "lru_one_pass", "miss_ratio_curves", "mrc", "native_available"]
