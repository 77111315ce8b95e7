"""The model forward, one MoE layer at a time: the MLX side of the forward actor.

`forward_steps` is Qwen3NextModel.__call__ cut at every MoE router: it evaluates the
router's ids, yields them (`LayerRoute`) and waits for the slots that hold those
experts (`PartGrant`), then runs them from the layer's slot arrays with the same kernels
as the all-resident model (qnpipe.model.experts.switch_glu). When one step's experts do
not fit a layer at once, the forward sends several parts, each a set of experts that fit
(`PartGrant.by_expert`: it runs every pair routed to them) or a range of tokens whose
experts fit; a part that is not the last is evaluated before the next is granted
(`PartDone`), so its slots can be rewritten.

An early grant (`PartGrant.early`: the experts in memory so far while the rest are read)
queues the work of the pairs it newly gives and yields `Queued` at once; there may be
several, as reads land; the full grant then runs the rest, and the pairs are put back in
the router's order before the same sum as one pass.

`MlxBackend` wraps it for the trio side: `begin` / `resume` each run on the MLX thread
until the next yield. Every yield but `Queued` follows an `mx.eval` that depends on all
expert work granted before it (the next router reads the layer's output), so when `resume`
returns, nothing queued can still read the slots it was given: the forward may release
them. After `Queued` the forward holds the grant until the full one's `resume` returns, and
a step dropped there first waits for the queued work (`run_parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from qnpipe.model.experts import LayerExperts, switch_glu
from qnpipe.model.qwen3_next import Model, SparseMoeBlock
from qnpipe.model.speculate import SlotWrites, Speculated, Speculation
from qnpipe.model.stage import Remote
from qnpipe.steps import Event, Hits, LayerRoute, PartDone, PartGrant, PredictPlan, Queued, StepDone, Tail


def forward_steps(model: Model, slots: dict[int, LayerExperts] | None, inputs: mx.array,
                  cache: list[Any], plan: PredictPlan | None = None, weights: bool = False,
                  spec: Speculation | None = None,
                  hits: Hits | None = None,
                  first_sync: Callable[[], bool] | None = None) -> Generator[LayerRoute | PartDone | Queued, PartGrant,
                                                                               mx.array | None]:
    """Post-final-norm hidden states `[B, L, H]` of `inputs [B, L]`, yielding at each MoE router.

    `weights`: also hand the router's gate weights to the host (the event log records them).

    `hits`: at each router, a layer whose grant is certain now (`Hits.hit_slots`) runs at once
    and is not yielded; the pipeline's turn for it (`Hits.hit_queued`) comes once its experts and
    the next layer's attention and router are queued (or at the step's end), while the device
    computes them. A yielded layer's grant the forward gave before its turn takes that turn at the
    same point (`Hits.grant_queued`, after every yielded layer: nothing when there is none). Not with `spec`, the other way to hide that turn (it learns
    its map from the grants the layers yield for).

    `first_sync` runs once, just after the step's first router sync (whose inputs needed the whole
    previous step, so its sampled token is ready by then); False ends the step there: it returns None.

    `spec`: queue each small step's experts before the router's sync, from the slots they had
    last time, and use them when the grant confirms (qnpipe.model.speculate).

    `slots` None: the experts attached to the model run in place (all resident, no yields).

    Pipeline parallel (qnpipe.model.stage): a rank after the first gets the previous rank's
    hidden state `[B, L, H]` as `inputs`, runs its own layers only, and a rank before the last
    returns its last layer's output (its final norm passes it through).
    """
    m = model.model
    h = inputs if inputs.ndim == 3 else m.embed_tokens(inputs)
    fa_mask, ssm_mask = m.masks(h, cache)
    held: tuple[LayerRoute, np.ndarray] | None = None  # a hit whose experts are queued, its turn not taken yet
    granted = False  # a yielded layer's work is queued: the forward's turn for a grant given before it is due
    for i, (layer, c) in enumerate(zip(m.layers, cache, strict=True)):
        if isinstance(layer, Remote):
            continue
        h = layer.mix(h, ssm_mask if layer.is_linear else fa_mask, c)
        moe = layer.mlp
        if slots is None or not isinstance(moe, SparseMoeBlock):
            h = h + moe(layer.post_attention_layernorm(h))
            continue
        x = layer.post_attention_layernorm(h)
        inds, scores = moe.route(x)
        preds = _predict(m, plan, i, x, h) if plan is not None else []
        shared = moe.shared(x)
        synced = (inds, scores, *[a for _, ids, p in preds for a in (ids, p)])
        ahead = _speculate(spec, i, slots[i], moe, x, h, synced, shared) if spec is not None else None
        if held is not None or granted:
            # The previous layer's hit takes its turn once this layer's attention and router are queued
            # too: taken before them, it would hold them back, and the device would wait. So does a grant
            # the forward gave before its turn (`Hits.grant_queued`).
            assert hits is not None
            mx.async_eval(*synced)
            if held is not None:
                hits.hit_queued(*held)
                held = None
            else:
                hits.grant_queued()
                granted = False
        mx.eval(*synced)  # one host sync for all
        if first_sync is not None:
            if not first_sync():
                return None
            first_sync = None
        # The shared expert needs no slot: it computes while the pool answers and reads.
        mx.async_eval(shared)
        k = inds.shape[-1]
        predictions = tuple((t, np.array(ids).reshape(-1, ids.shape[-1]),
                             np.array(p.astype(mx.float32)).reshape(-1, p.shape[-1])) for t, ids, p in preds)
        w = np.array(scores.astype(mx.float32)).reshape(-1, k) if weights else None
        ids = np.array(inds)
        route = LayerRoute(i, ids.reshape(-1, k), predictions, w)
        if hits is not None and spec is None and (hit := hits.hit_slots(route)) is not None:
            # The one-part grant's very call (run_parts), so the bits are the same either way.
            y = native_run(slots[i])(x, ids, hit.reshape(ids.shape))
            h = h + moe.combine(x, y, scores, shared)
            mx.async_eval(h)
            held = (route, hit)
            continue
        grant = yield route
        granted = hits is not None
        full = grant.last and grant.lo == 0 and not grant.early
        if ahead is not None and spec is not None and spec.confirm(i, ahead, ids, grant.slots if full else None):
            h = ahead.h  # already queued
            continue
        if full and spec is not None and ids.size <= SPECULATE_PAIRS:
            spec.learn(i, ids, grant.slots)
        y = yield from run_parts(native_run(slots[i]), x, ids, grant)
        h = h + moe.combine(x, y, scores, shared)
        # Start computing this layer while Python builds the next one up to its router.
        mx.async_eval(h)
    if held is not None:
        assert hits is not None
        hits.hit_queued(*held)
    elif granted:
        assert hits is not None
        hits.grant_queued()
    return m.norm(h)


# Steps of at most this many (token, expert) pairs speculate (decode, MTP's verify steps): a
# discarded prefill chunk's experts would cost the device a whole layer's expert work.
SPECULATE_PAIRS = 64


def _speculate(spec: Speculation, layer: int, w: LayerExperts, moe: SparseMoeBlock, x: mx.array, h: mx.array,
               synced: tuple[mx.array, ...], shared: mx.array) -> Speculated | None:
    """Queue the layer's output from the slots the map gives (qnpipe.model.speculate), or None.
    `synced` (the router's ids and scores first) is what the host syncs on next."""
    inds, scores = synced[0], synced[1]
    if inds.size > SPECULATE_PAIRS:
        return None
    got = spec.slots(layer, inds)
    if got is None:
        return None
    dev, host, epoch = got
    # Queued apart first: an array evaluated with others waits for all of them (one event per
    # eval), so the host's sync would wait for the speculated experts too, and nothing would overlap.
    mx.async_eval(*synced)
    out = h + moe.combine(x, switch_glu(w, x, dev), scores, shared)
    mx.async_eval(out)
    return Speculated(out, host, epoch)


@attrs.frozen
class MtpRun:
    """A step of the MTP head instead of the main model (what `inputs()` returns for one): rows
    (`hidden [1, L, H]`, `tokens [1, L]`) at `cache`'s next positions; its MoE is layer `head.layer_id`."""

    head: Any  # qnpipe.model.mtp.MtpHead
    hidden: mx.array
    tokens: mx.array
    cache: Any


def mtp_steps(model: Model, slots: dict[int, LayerExperts], run: MtpRun,
              weights: bool = False) -> Generator[LayerRoute | PartDone | Queued, PartGrant, tuple[mx.array, mx.array, mx.array]]:
    """The MTP head's forward with its experts from the pool: one MoE layer, one yield (or parts)."""
    head = run.head
    h = head.mix(model, run.hidden, run.tokens, run.cache)
    x = head.post_attention_layernorm(h)
    inds, scores = head.mlp.route(x)
    shared = head.mlp.shared(x)
    mx.eval(inds, scores)
    mx.async_eval(shared)
    k = inds.shape[-1]
    w = np.array(scores.astype(mx.float32)).reshape(-1, k) if weights else None
    ids = np.array(inds)
    grant = yield LayerRoute(head.layer_id, ids.reshape(-1, k), (), w)
    y = yield from run_parts(native_run(slots[head.layer_id]), x, ids, grant)
    # Every MTP step's tail (SpecState.mtp_tail, mtp_out) reads the last row's logits alone.
    return head.finish(model, h + head.mlp.combine(x, y, scores, shared), last_only=True)


def _predict(m: Any, plan: PredictPlan, layer: int, x: mx.array, h: mx.array) -> list[tuple[int, mx.array, mx.array]]:
    """Top-`width` experts of each target layer's gate on this layer's input (the router's own softmax)."""
    out = []
    for t in plan.targets.get(layer, ()):
        target = m.layers[t]
        xin = x if plan.use_moe_input else target.post_attention_layernorm(h)
        probs = mx.softmax(target.mlp.gate(xin), axis=-1, precise=True)
        w = min(plan.width, probs.shape[-1])
        ids = mx.argpartition(probs, kth=-w, axis=-1)[..., -w:]
        out.append((t, ids, mx.take_along_axis(probs, ids, axis=-1)))
    return out


# Runs experts: `run(x [..., H], ids [..., k], slots [..., k]) -> [..., k, H]`, the router's ids and
# the slots holding them (numpy, same shape). The native path reads only the slots; the family seam
# (qnpipe.model.family.pooled) keeps mlx-lm's row order by the ids and maps them to the slots.
RunExperts = Callable[[mx.array, np.ndarray, np.ndarray], mx.array]


def native_run(w: LayerExperts) -> RunExperts:
    """The native path's experts: qnpipe's copy of mlx-lm's SwitchGLU over the slot arrays."""
    return lambda x, ids, slots: switch_glu(w, x, mx.array(slots, dtype=mx.uint32))


def run_parts(run: RunExperts, x: mx.array, ids: np.ndarray,
               grant: PartGrant) -> Generator[PartDone | Queued, PartGrant, mx.array]:
    """The layer's expert outputs `[*ids.shape, H]` over the grants of one layer-step (`ids` the
    router's, shaped like its output)."""
    shape = ids.shape
    early: tuple[np.ndarray, list[mx.array]] | None = None
    while grant.early:  # each early grant: the pairs whose expert is now in memory start at once
        early = _queue_present(run, x, ids, grant.slots, early)
        try:
            grant = yield Queued()
        except GeneratorExit:
            mx.eval(early[1])  # the step is dropped: its reads of the held slots end before they are released
            raise
    if early is not None:
        assert grant.last and grant.lo == 0, grant
    if grant.last and grant.lo == 0:
        slots = grant.slots.reshape(shape)
        if early is not None:
            return _complete(run, x, ids, slots, early)
        # One part: the very shapes the all-resident block uses, so results match it bit for bit.
        return run(x, ids, slots)
    if grant.by_expert:
        return (yield from _expert_parts(run, x, ids, grant))
    flat = x.reshape(-1, x.shape[-1])
    flat_ids = ids.reshape(-1, shape[-1])
    outs = []
    while True:
        y = run(flat[grant.lo:grant.hi], flat_ids[grant.lo:grant.hi], grant.slots)
        outs.append(y)
        if grant.last:
            break
        mx.eval(y)
        grant = yield PartDone()
    return mx.concatenate(outs, axis=0).reshape(*shape, x.shape[-1])


# Below this many (token, expert) pairs a layer-step takes early grants: the switch does not sort
# them, so every pair is its own row of the kernels and splitting the pairs changes no bit.
EARLY_PAIRS = 64


def _pairs(run: RunExperts, x: mx.array, ids: np.ndarray, pairs: np.ndarray, slots: np.ndarray) -> mx.array:
    """The experts' outputs `[P, H]` of the (token, expert) pairs `pairs` (flat index t*k + j)."""
    k = slots.shape[-1]
    rows = x.reshape(-1, x.shape[-1])[mx.array(pairs // k)]
    return run(rows, ids.reshape(-1)[pairs][:, None], slots.reshape(-1)[pairs][:, None])[:, 0]


def _expert_parts(run: RunExperts, x: mx.array, ids: np.ndarray,
                  grant: PartGrant) -> Generator[PartDone, PartGrant, mx.array]:
    """`[*ids.shape, H]` over expert-major parts: each runs the pairs its experts have slots for (the
    others' are -1) in one call, in ascending pair order; the last puts every pair back in its place.
    A pair's output row does not depend on the other rows of its call (tests/model/test_pair_rows.py),
    so this equals the one-pass call bit for bit."""
    done: list[np.ndarray] = []
    ys: list[mx.array] = []
    while True:
        assert grant.by_expert and not grant.early, grant
        pairs = np.flatnonzero(grant.slots.reshape(-1) >= 0)
        if pairs.size:
            done.append(pairs)
            ys.append(_pairs(run, x, ids, pairs, grant.slots))
        if grant.last:
            break
        if ys:
            mx.eval(ys[-1])  # before the next part's grant may rewrite these slots
        grant = yield PartDone()
    order = np.concatenate(done)
    assert order.size == ids.size, "every pair runs in exactly one part"
    return _in_place(ys, order, ids.shape, x.shape[-1])


def _queue_present(run: RunExperts, x: mx.array, ids: np.ndarray, slots: np.ndarray,
                   early: tuple[np.ndarray, list[mx.array]] | None) -> tuple[np.ndarray, list[mx.array]]:
    """Start the pairs whose expert has a slot (the rest is -1) and that `early` has not started:
    their outputs compute meanwhile. Returns every started pair (flat index) and their outputs."""
    assert slots.size < EARLY_PAIRS, "an early grant with pairs the switch would sort"
    ready = slots.reshape(-1) >= 0
    if early is not None:
        ready[early[0]] = False
    pairs = np.flatnonzero(ready)
    if early is None:
        early = (pairs[:0], [])
    if not pairs.size:
        return early
    y = _pairs(run, x, ids, pairs, slots)
    mx.async_eval(y)
    return np.concatenate([early[0], pairs]), [*early[1], y]


def _complete(run: RunExperts, x: mx.array, ids: np.ndarray, slots: np.ndarray,
              early: tuple[np.ndarray, list[mx.array]]) -> mx.array:
    """`[..., k, H]` from the early pairs' outputs and the rest's, each pair back in its place."""
    done, ys = early
    todo = np.ones(slots.size, dtype=bool)
    todo[done] = False
    rest = np.flatnonzero(todo)
    if rest.size:
        ys = [*ys, _pairs(run, x, ids, rest, slots)]
    return _in_place(ys, np.concatenate([done, rest]), slots.shape, x.shape[-1])


def _in_place(ys: list[mx.array], order: np.ndarray, shape: tuple[int, ...], width: int) -> mx.array:
    """`[*shape, width]`: the rows of `ys` (pairs `order`, each pair once) back in pair order."""
    y = (mx.concatenate(ys, axis=0) if len(ys) > 1 else ys[0])[mx.array(np.argsort(order))]
    return y.reshape(*shape, width)


class MlxBackend:
    """One step at a time of `forward_steps`, driven from trio. MLX thread only."""

    early_pairs = EARLY_PAIRS
    takes_hits = True  # `begin` takes the forward's `hits` and `first_sync`

    def __init__(self, model: Model, slots: dict[int, LayerExperts] | None,
                 plan: PredictPlan | None = None, weights: bool = False) -> None:
        self.model = model
        # The kernels see the model's expert count, not the pool's capacity (experts.expert_view).
        self.slots = None if slots is None else {
            i: w.seen_as(model.args.num_experts) for i, w in slots.items()}
        self.plan = plan
        self.weights = weights
        self._gen: Generator[LayerRoute | PartDone | Queued, PartGrant, Any] | None = None
        self._tail: Tail | None = None
        # Pipeline parallel on rank 0 (qnpipe.live.parallel.lead): turns a step's tail into a pass
        # around the ring, (tail, cache) -> the tail rank 0 runs.
        self.ring_tail: Callable[[Tail, list[Any]], Tail] | None = None
        # Hits queued before the pool answers (`speculate`); None: never.
        self.spec: Speculation | None = None

    def speculate(self, writes: SlotWrites) -> Speculation:
        """Queue small steps' experts before the router's sync from here on (qnpipe.model.speculate);
        `writes` must see every write into the slot arrays."""
        assert self.slots is not None, "speculation needs slots"
        self.spec = Speculation(writes, self.model.args.num_experts)
        return self.spec

    def begin(self, inputs: Callable[[], mx.array], cache: list[Any], tail: Tail, hits: Hits | None = None,
              first_sync: Callable[[], bool] | None = None) -> Event:
        """Start a step on `inputs() [B, L]` (uint32, built here) and run it to its first yield.
        `hits`: run the layers it grants at once without yielding; `first_sync`: called after the first
        router's sync, False ends the step there with `StepDone(None, stopped=True)` (`forward_steps`)."""
        self.abort()
        x = inputs()
        if isinstance(x, MtpRun):
            assert self.slots is not None, "an MTP step through the pool needs slots"
            self._gen = mtp_steps(self.model, self.slots, x, self.weights)
        else:
            # Pipeline parallel: every step rank 0 begins goes round the ring (its tail), so none stops early.
            self._gen = forward_steps(self.model, self.slots, x, cache, self.plan, self.weights, self.spec,
                                      None if self.slots is None else hits,
                                      first_sync if self.ring_tail is None else None)
        self._tail = tail if self.ring_tail is None else self.ring_tail(tail, cache)
        return self._advance(None)

    def resume(self, grant: PartGrant) -> Event:
        """Continue the step with the slots of the part it asked for."""
        return self._advance(grant)

    def _advance(self, grant: PartGrant | None) -> Event:
        assert self._gen is not None and self._tail is not None, "no step in progress"
        try:
            ev = next(self._gen) if grant is None else self._gen.send(grant)
        except StopIteration as stop:
            self._gen = None
            if stop.value is None:  # first_sync stopped it
                return StepDone(None, stopped=True)
            return StepDone(self._tail(stop.value))
        return ev

    def abort(self) -> None:
        """Drop a step in progress (its cache updates so far stay: start a fresh cache after this)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None
