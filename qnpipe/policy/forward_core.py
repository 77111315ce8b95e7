"""The forward's decisions, sans I/O: a layer's route in, the messages and the compute to run out.

Both drivers run it: the trio actor (qnpipe.actors.forward, over the MLX model or replay's
recorded routes) and replay's heap driver (qnpipe.replay.fast). For each MoE layer of a
step, `route` gives the predictor its candidates (with the pace's deadlines; those the
predictor's full inbox cannot take are dropped and counted), the event log its route
record, splits the step into parts that fit the layer (qnpipe.policy.parts: sets of experts
with `by_expert`, forward.parts=experts; else token ranges), chooses whether the part asks
for early grants, and sends the first part's `Acquire`.
`handle(grant, now)` answers a `Granted` with the part to run (`Outbox.run`: its tokens'
slots through the layer's lookup table) and a `Present` with the early work to queue;
`part_done` releases the part (with route verification's tokens and slots) and asks for
the next, or ends the layer-step. A grant of a step that was cancelled is dropped: the
pool has had its `Release` (`cancel`).

With `hold_last_release` a layer-step's last `Release` is held and sent with the next
`route`'s `Acquire` (or `end_step`'s `ForwardDone`, or `cancel`'s): the backend returns
from a layer's last part with the next layer's route, so both drivers send the two in the
same action anyway, and the acquire's sender then finds the pool's inbox empty
(qnpipe.actors.pool.InlinePool, replay's heap driver's inline hits).

The forward's capacity of a layer is the pool's minus its pinned experts
(`forward_capacities`): a step can always get that many slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, assert_never

import attrs
import numpy as np

from qnpipe.messages import Acquire, Candidates, ForwardDone, ForwardInbox, Granted, Job, PoolInbox, Present, Release
from qnpipe.policy.outbox import Outbox
from qnpipe.policy.pace import Pace
from qnpipe.policy.parts import Part, Splitter
from qnpipe.steps import PartGrant
from qnpipe.trace.format import UnionSize, route_record

if TYPE_CHECKING:
    from qnpipe.policy.pool import PoolPolicy

# What the predictor gets at one layer-step: (target, ids [N, W], scores [N, W]) per target layer.
Predictions = tuple[tuple[int, np.ndarray, np.ndarray], ...]
_NO_SLOTS = np.empty((0, 0), dtype=np.int64)


def forward_capacities(capacities: dict[int, int], policy: PoolPolicy) -> dict[int, int]:
    """Slots a step can always get per layer: the layer's capacity minus its pinned experts."""
    return {layer: cap - len(policy.tables[layer].pinned) for layer, cap in capacities.items()}


@attrs.define
class ForwardStats:
    steps: int = 0
    layer_steps: int = 0
    split_layer_steps: int = 0  # layer-steps that needed more than one part
    early_grants: int = 0  # parts whose experts in memory started before the rest were read
    stall_s: float = 0.0  # waiting for grants that had misses
    stall_by_layer: dict[int, float] = attrs.field(factory=dict)
    candidates_dropped: int = 0  # the predictor's inbox was full
    union_sizes: dict[tuple[int, int], list[int]] = attrs.field(factory=dict)  # (tokens, layer) -> [n, sum, max]


@attrs.frozen(kw_only=True)
class ForwardStatistics:
    """`ForwardStats` at one moment, detached from the live counters; `union_sizes`: (tokens, layer) ->
    (layer-steps, sum, max) of distinct experts."""

    steps: int
    layer_steps: int
    split_layer_steps: int
    early_grants: int
    stall_s: float
    stall_by_layer: dict[int, float]
    candidates_dropped: int
    union_sizes: dict[tuple[int, int], tuple[int, int, int]]


class _LayerStep:
    """The layer-step in progress: its parts, the part being acquired or run, the layer's lookup table.

    A plain slotted class: one is made per layer-step, on replay's hot path."""

    __slots__ = ("acquired", "early", "ids", "layer", "lut", "owner", "pairs", "part", "parts", "slots", "t0")

    def __init__(self, layer: int, ids: np.ndarray | None, parts: list[Part], early: bool,
                 lut: np.ndarray | None, pairs: list[float] | None = None) -> None:
        self.layer = layer
        self.ids = ids  # [N, k]; None when neither slots nor route verification are wanted
        self.parts = parts
        self.early = early
        self.lut = lut  # expert -> slot of the grants so far (None: the driver needs no slots)
        self.part = 0
        self.t0 = 0.0  # when the part's Acquire went out
        self.acquired = False  # the part's Acquire went out and its Release did not
        self.slots = _NO_SLOTS  # the part's tokens' slots, once granted
        self.pairs = pairs  # expert-major parts (more than one): each part's (token, expert) pairs / top-k
        self.owner: np.ndarray | None = None  # [N, k]: each pair's expert-major part (when slots are wanted)


@attrs.define
class ForwardCore:
    """The forward's step logic (see the module doc); `capacities` are the forward's (`forward_capacities`).

    `early_pairs`: a one-part layer-step of fewer (token, expert) pairs asks for early grants
    (0 = never). `slots`: the driver needs each part's slots (a model does; replay's heap
    driver only for route verification). `logging`: fill `Outbox.log` with the records.
    """

    capacities: dict[int, int]
    num_experts: int
    moe_order: dict[int, int] = attrs.field(factory=dict)  # MoE layer -> its index (deadline estimates)
    early_pairs: int = 0
    route_verify: bool = False
    slots: bool = True
    logging: bool = False
    union_prof: bool = False  # diag.union_prof: per-layer union sizes by step length
    router_order: bool = False  # replay.step_order=router: a part's experts served as the router names them
    by_expert: bool = False  # forward.parts=experts: a split layer-step's parts are sets of experts
    hold_last_release: bool = False  # a layer-step's last Release goes with the next message (module doc)
    stats: ForwardStats = attrs.field(factory=ForwardStats)
    step: int = 0
    seq: int = 0
    pace: Pace = attrs.field(init=False)
    _at: _LayerStep | None = None
    # expert -> slot per layer, written by each grant: a part's tokens only route to experts its grant gave,
    # so the entries of others may be stale (an early layer-step clears its own first: -1 = not there yet).
    _luts: dict[int, np.ndarray] = attrs.field(factory=dict)
    _held: list[PoolInbox] = attrs.field(factory=list)  # the last Release of a layer-step (hold_last_release)
    _splitter: Splitter | None = None  # made at the first route: `by_expert` and `router_order` are set by then

    def __attrs_post_init__(self) -> None:
        self.pace = Pace(self.moe_order)

    def _seq(self) -> int:
        self.seq += 1
        return self.seq

    def statistics(self) -> ForwardStatistics:
        s = self.stats
        return ForwardStatistics(
            steps=s.steps, layer_steps=s.layer_steps, split_layer_steps=s.split_layer_steps,
            early_grants=s.early_grants, stall_s=s.stall_s, stall_by_layer=dict(s.stall_by_layer),
            candidates_dropped=s.candidates_dropped,
            union_sizes={key: (c, t, mx) for key, (c, t, mx) in s.union_sizes.items()})

    def begin_step(self) -> int:
        """A new step starts; returns its number (from 1)."""
        self.step += 1
        self.pace.new_step()
        self._at = None
        return self.step

    def drop_step(self) -> None:
        """The step began and was stopped before its first route: as if it never began (no `ForwardDone`)."""
        assert self._at is None and not self._held, "only a step that routed nothing can be dropped"
        self.step -= 1

    def end_step(self, now: float) -> Outbox:
        """The step's last layer is done: the pool's `ForwardDone`."""
        self.stats.steps += 1
        out = self._outbox()
        out.pool.append(ForwardDone(t=now, seq=self._seq(), step=self.step))
        return out

    def route(self, layer: int, experts: Sequence[int], k: int, now: float, *, ids: np.ndarray | None = None,
              weights: np.ndarray | None = None, predictions: Predictions = (), room: int = 0) -> Outbox:
        """MoE layer `layer` routes its tokens to `experts` (flat, `k` per token; `ids` the same [N, k] if
        the driver has them): the predictor's candidates (`room` of them fit its inbox, the rest are
        dropped), the route record, the parts, and the first part's `Acquire`."""
        self.pace.observe(now)
        out = self._outbox()
        for target, cand, probs in predictions:  # (none when the driver predicts nothing)
            c = Candidates(t=now, seq=self._seq(), step=self.step, layer=layer, target=target, width=cand.shape[-1],
                           token_experts=tuple(cand.reshape(-1).tolist()),
                           token_scores=tuple(probs.reshape(-1).tolist()),
                           deadline=self.pace.deadline(now, layer, target))
            if self.logging:
                out.log.append(c)
            if room > 0:
                out.predictor.append(c)
                room -= 1
            else:  # advisory: a busy predictor loses the hint, the forward never waits
                self.stats.candidates_dropped += 1
        if ids is None and (self.logging or self.slots or self.route_verify):
            ids = np.asarray(experts, dtype=np.int64).reshape(-1, k)
        if self.logging:
            assert ids is not None
            out.log.append(route_record({"t": now, "seq": self._seq()}, self.step, layer, ids, weights))
        split = self._splitter
        if split is None:
            split = self._splitter = Splitter(self.by_expert, router_order=self.router_order)
        parts, counts = split.split(experts, k, self.capacities[layer], layer)
        pair_tokens = None if counts is None else [p / k for p in counts]
        if self.union_prof:
            n, union = len(experts) // k, len({e for _, _, ex in parts for e in ex})
            acc = self.stats.union_sizes.setdefault((n, layer), [0, 0, 0])
            acc[0] += 1
            acc[1] += union
            acc[2] = max(acc[2], union)
            if self.logging:
                out.log.append(UnionSize(t=now, seq=self._seq(), step=self.step, layer=layer, tokens=n, union=union))
        stats = self.stats
        stats.layer_steps += 1
        if len(parts) > 1:
            stats.split_layer_steps += 1
        early = len(parts) == 1 and len(experts) < self.early_pairs
        lut = None
        if self.slots or self.route_verify:
            lut = self._luts.get(layer)
            if lut is None:
                lut = self._luts[layer] = np.full(self.num_experts, -1, dtype=np.int64)
            if early:  # a Present maps only the experts in memory: the others must read -1
                lut[list(parts[0][2])] = -1
        self._at = at = _LayerStep(layer, ids, parts, early, lut, pair_tokens)
        if pair_tokens is not None and lut is not None and ids is not None:
            owner = np.full(self.num_experts, -1, dtype=np.int64)
            for p, (_, _, ex) in enumerate(parts):
                owner[list(ex)] = p
            at.owner = owner[ids]
        self._acquire(at, now, out)
        return out

    def handle(self, msg: ForwardInbox, now: float) -> Outbox:
        """A grant from the pool: `Outbox.run` is the part to run (early: the work to queue), or None
        for a grant of a cancelled step. AssertionError for a grant the forward never asked for."""
        out = Outbox()
        at = self._at
        match msg:
            case Granted() | Present() if (at is None or msg.part != at.part or msg.layer != at.layer
                                           or msg.step != self.step):
                # A grant completed just as its step was cancelled: the pool has had its Release.
                if msg.step >= self.step:
                    want = None if at is None else (self.step, at.layer, at.part)
                    raise AssertionError(f"grant {(msg.step, msg.layer, msg.part)} while waiting for {want}")
            case Granted():
                assert at is not None
                if msg.misses:
                    waited = now - at.t0
                    self.stats.stall_s += waited
                    self.stats.stall_by_layer[at.layer] = self.stats.stall_by_layer.get(at.layer, 0.0) + waited
                lo, hi, _ = at.parts[at.part]
                at.slots = _NO_SLOTS if at.lut is None else self._slots(at, msg.experts, msg.slots, lo, hi)
                last = at.part == len(at.parts) - 1
                if at.pairs is None:
                    out.run = PartGrant(lo, hi, at.slots, last, misses=msg.misses)
                else:  # the pairs of the layer's other parts read -1 (their lut entries may be stale)
                    if at.owner is not None:
                        at.slots = np.where(at.owner == at.part, at.slots, -1)
                    out.run = PartGrant(lo, hi, at.slots, last, misses=msg.misses, by_expert=True,
                                        pair_tokens=at.pairs[at.part])
            case Present():
                assert at is not None
                self.stats.early_grants += 1
                lo, hi, _ = at.parts[at.part]  # these start now, the rest are being read
                out.run = PartGrant(lo, hi, self._slots(at, msg.experts, msg.slots, lo, hi), True, early=True)
            case _:
                assert_never(msg)
        return out

    def foresee(self, reads: Iterable[Job]) -> PartGrant | None:
        """The full grant of the early part being acquired as the pool's `Granted` will give it, once `reads` are
        done, when they hold the read of every expert of the part not in memory yet (none given by a `Present`);
        None when they do not (the grant comes as usual), or the part is not an early one. Its `misses` counts
        those reads. Nothing changes here: the grant, handled, writes the same slots in the lookup table."""
        at = self._at
        if at is None or not at.early or not at.acquired or at.lut is None or at.ids is None:
            return None
        lo, hi, experts = at.parts[at.part]
        layer, lut = at.layer, at.lut
        slot_of = {j.expert: j.slot for j in reads if j.layer == layer}
        missing = [e for e in experts if lut[e] < 0]
        if not missing or any(e not in slot_of for e in missing):
            return None
        lut = lut.copy()
        lut[missing] = [slot_of[e] for e in missing]
        return PartGrant(lo, hi, lut[at.ids[lo:hi]], at.part == len(at.parts) - 1, misses=len(missing))

    def end_turn(self, now: float) -> Outbox:
        """The forward takes no turns (it acts before the actors at each instant): nothing to send."""
        return Outbox()

    def part_done(self, now: float) -> Outbox:
        """The backend returned from the granted part: its `Release`, then the next part's `Acquire`."""
        at = self._at
        assert at is not None and at.acquired
        out = Outbox()
        if self.route_verify:
            assert at.ids is not None
            lo, hi, _ = at.parts[at.part]
            ids, slots = at.ids[lo:hi], at.slots
            if at.owner is not None:  # an expert-major part read the pairs of its own experts only
                mine = at.owner == at.part
                ids, slots = ids[mine], slots[mine]
            out.pool.append(Release(t=now, seq=self._seq(), step=self.step, layer=at.layer, part=at.part,
                                    token_experts=tuple(ids.reshape(-1).tolist()),
                                    token_slots=tuple(slots.reshape(-1).tolist())))
        else:
            out.pool.append(Release(t=now, seq=self._seq(), step=self.step, layer=at.layer, part=at.part))
        at.acquired = False
        at.slots = _NO_SLOTS
        at.part += 1
        if at.part < len(at.parts):
            self._acquire(at, now, out)
        else:
            self._at = None
            if self.hold_last_release:
                self._held += out.pool
                out.pool = []
        return out

    def cancel(self, now: float) -> Outbox:
        """The step stops: the `Release` of a part acquired and not released (its grant may still come)."""
        at, self._at = self._at, None
        out = self._outbox()  # released parts, due before the cancelled one
        if at is not None and at.acquired:
            out.pool.append(Release(t=now, seq=self._seq(), step=self.step, layer=at.layer, part=at.part))
        return out

    def _outbox(self) -> Outbox:
        """A new answer, starting with the Release held back (if any)."""
        out = Outbox()
        if self._held:
            out.pool, self._held = self._held, []
        return out

    def _acquire(self, at: _LayerStep, now: float, out: Outbox) -> None:
        at.t0 = now
        at.acquired = True
        out.pool.append(Acquire(t=now, seq=self._seq(), step=self.step, layer=at.layer, part=at.part,
                                experts=at.parts[at.part][2], early=at.early))

    def _slots(self, at: _LayerStep, experts: tuple[int, ...], slots: tuple[int, ...], lo: int,
               hi: int) -> np.ndarray:
        if at.lut is None:
            return _NO_SLOTS
        at.lut[list(experts)] = slots
        assert at.ids is not None
        return at.lut[at.ids[lo:hi]]


__all__ = ["ForwardCore", "ForwardStatistics", "ForwardStats", "Predictions", "forward_capacities"]
