"""The MLX-thread half of MTP speculation: options, the cache list, and the per-round state.

`SpecState` owns the caches (`SpecCaches.all`: the main model's, then the MTP layer's), the
drafter's pending row, and the tails the forward's steps end with; qnpipe.live.mtp.loop drives it
from trio (docs/model.md, "MTP speculation").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from qnpipe.config import MtpHidden, MtpVerifyMode
from qnpipe.errors import SnapshotError
from qnpipe.live.mtp.sampling import draw, probs
from qnpipe.live.mtp.tree import Branch
from qnpipe.messages import Msg
from qnpipe.model.decode import chunks
from qnpipe.model.mtp import MtpHead
from qnpipe.model.qwen3_next import Model
from qnpipe.model.snapshots import Snapshot, restore
from qnpipe.model.step_cache import StepCache
from qnpipe.model.stepper import MtpRun

# Test hook: (tokens generated so far, the drafter's drafts) -> the drafts to verify instead.
Oracle = Callable[[int, list[int]], list[int]]


@attrs.frozen
class SpecOptions:
    """How to speculate (from `cfg.mtp`); `rollback` "states" keeps per-token GDN states, "rerun" re-forwards."""

    k: int = 3
    verify_mode: MtpVerifyMode = MtpVerifyMode.BATCH
    hidden: MtpHidden = MtpHidden.POST_NORM
    adaptive_depth: bool = False
    conf_tau: float = 0.3
    depth_max: int = 3
    accept_topk: int = 0
    rollback: str = "states"
    oracle: Oracle | None = None
    emit: Callable[[Msg], None] | None = None  # the event log's (qnpipe.actors.recorder): one record per round
    mtp_streamed: bool = False  # the head's experts come from the pool: each MTP call is a forward step
    branches: tuple[Branch, ...] = ()  # extra draft paths verified as one batch (qnpipe.live.mtp.tree)
    temperature: float = 0.0  # > 0: speculative sampling (qnpipe.live.mtp.sampling)
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0

    @property
    def sampling(self) -> bool:
        return self.temperature > 0.0

    @property
    def max_depth(self) -> int:
        return self.depth_max if self.adaptive_depth else self.k


class SpecCaches:
    """The main model's caches (GDN layers as `StepCache`) followed by the MTP layer's. MLX thread only."""

    def __init__(self, model: Model, head: MtpHead) -> None:
        self.all: list[Any] = [StepCache() if layer.is_linear else KVCache() for layer in model.layers]
        self.all.append(head.make_cache())

    @property
    def main(self) -> list[Any]:
        return self.all[:-1]

    @property
    def mtp(self) -> KVCache:
        return self.all[-1]


@attrs.define
class Draft:
    tokens: list[int]
    topk: list[list[int]]


@attrs.define
class Pending:
    """A verified round whose rollback and MTP repair are still to be applied (lazily, with the next draft)."""

    drafted: int
    accepted: int
    hidden: mx.array
    rows: list[int]
    rolled_back: bool = False
    mtp_trim: int | None = None  # provisional MTP entries to drop (None: drafted - 1)
    row: int = 0  # the batch row of `hidden` that was committed (tree verify)


class SpecState:
    """The loop's MLX-thread half: the caches, the drafter's pending row, the tails.

    A round is one thread hop: the verify step's `inputs` callable applies the previous
    round's rollback and MTP repair and builds the drafts, all lazily, so the drafter's
    work is evaluated with the verify forward (one host sync per round) unless the drafts
    must be seen first (adaptive depth, the oracle).
    """

    def __init__(self, model: Model, head: MtpHead, opts: SpecOptions) -> None:
        mx.reset_peak_memory()
        self.model = model
        self.head = head
        self.opts = opts
        self.caches = SpecCaches(model, head)
        self.logits: mx.array | None = None  # the last MTP row's logits: d_1 of the next round
        self.feed: mx.array | None = None  # the hidden a chained draft step reads [1, 1, H]
        self.saved: list[Any] = []  # "rerun": the GDN states before the verify
        self.pending: Pending | None = None
        self.drafts: list[mx.array] = []
        self.topk: list[mx.array] = []
        self.host_drafts: list[int] | None = None
        self.q: list[np.ndarray] = []  # sampling: the distribution each draft was drawn from
        self.rng = np.random.default_rng(opts.seed)
        self.done = 0  # tokens generated before this round (the oracle's index)

    def dist(self, logits: mx.array) -> np.ndarray:
        """Sampling: the distribution plain sampling draws from (host, float64)."""
        return probs(np.array(logits.astype(mx.float32)), self.opts.temperature, self.opts.top_p,
                     self.opts.top_k, self.opts.min_p)

    def drafter_input(self, h: mx.array) -> mx.array:
        """The main model's hidden as the drafter reads it (`mtp.hidden`).

        The forward yields post-norm states x̂ = x / rms(x) ⊙ w; x̂ ⊘ w is the pre-norm x up
        to its per-row scale, which the drafter's first RMSNorm removes.
        """
        if self.opts.hidden is MtpHidden.POST_NORM:
            return h
        w = self.model.model.norm.weight
        return h / mx.where(w == 0, 1, w)

    def resume(self, snap: Snapshot) -> None:
        """The caches (main layers, then the MTP layer's) in the state of a prefix snapshot of `SpecCaches.all`."""
        layers = restore(snap)
        if len(layers) != len(self.caches.all):
            raise SnapshotError(f"a snapshot of {len(layers)} layers, this MTP engine has {len(self.caches.all)} caches")
        for i, c in enumerate(layers):
            if c is None:  # a layer another rank runs (pipeline parallel): its unused cache stays
                continue
            own = self.caches.all[i]
            if isinstance(own, StepCache) and isinstance(c, ArraysCache):  # keep the kind verify steps record in
                own.cache = c.cache
            else:
                self.caches.all[i] = c

    def hidden_tail(self, h: mx.array) -> mx.array:
        mx.eval(h, [c.state for c in self.caches.main])
        return h

    def first_token(self, h: mx.array) -> tuple[int, mx.array]:
        if self.opts.sampling:
            p = self.dist(self.model.head(h[:, -1, :])[0])
            mx.eval(h, [c.state for c in self.caches.main])
            return draw(p, self.rng), h
        tok = mx.argmax(self.model.head(h[:, -1, :])[0], axis=-1)
        mx.eval(tok, h, [c.state for c in self.caches.main])
        return int(tok.item()), h  # pyright: ignore[reportArgumentType]

    def mtp_rows(self, hidden: mx.array, next_tokens: Sequence[int], chunk: int = 0, sync: bool = True) -> None:
        """Run the MTP on rows (hidden[t], next_tokens[t]) at the cache's next positions."""
        toks = mx.array(list(next_tokens), dtype=mx.uint32)[None]
        feed = self.drafter_input(hidden)
        for lo, hi in chunks(toks.shape[1], chunk):
            logits, out, pre = self.head(self.model, feed[:, lo:hi], toks[:, lo:hi], self.caches.mtp, last_only=True)
            self.logits = logits[0, -1]
            self.feed = (out if self.opts.hidden is MtpHidden.POST_NORM else pre)[:, -1:]
            if sync:
                mx.eval(self.logits, self.feed, self.caches.mtp.state)

    def draft(self) -> None:
        """d_1 from the pending row, then chained MTP steps (`k`, or adaptive depth): lazily when it can."""
        assert self.logits is not None and self.feed is not None
        o = self.opts
        logits, feed = self.logits, self.feed
        self.drafts, self.topk, self.host_drafts, self.q = [], [], None, []
        conf = 1.0
        while True:
            if o.sampling:
                q = self.dist(logits)
                self.q.append(q)
                d = mx.array(draw(q, self.rng), dtype=mx.uint32)
            else:
                d = mx.argmax(logits, axis=-1)
            self.drafts.append(d)
            if o.accept_topk > 0:
                kk = min(o.accept_topk, logits.shape[-1])
                self.topk.append(mx.argpartition(-logits, kth=kk - 1)[:kk])
            if len(self.drafts) >= o.max_depth:
                break
            if o.adaptive_depth and o.sampling:
                conf *= float(self.q[-1][int(d.item())])  # pyright: ignore[reportArgumentType]
                if conf < o.conf_tau:
                    break
            elif o.adaptive_depth:
                p = mx.softmax(logits.astype(mx.float32), axis=-1)[d]
                conf *= float(p.item())  # pyright: ignore[reportArgumentType]  # a probability: a real scalar
                if conf < o.conf_tau:
                    break
            lg, out, pre = self.head(self.model, feed, d.reshape(1, 1).astype(mx.uint32), self.caches.mtp)
            logits = lg[0, -1]
            feed = out if o.hidden is MtpHidden.POST_NORM else pre
        if o.oracle is not None:
            mx.eval(self.drafts)
            self.host_drafts = o.oracle(self.done, [int(t.item()) for t in self.drafts])  # pyright: ignore[reportArgumentType]

    def round_inputs(self, x: int) -> mx.array:
        """The verify step's inputs `[x, d_1 … d_K]`, after applying the previous round's repair."""
        self.apply_pending()
        self.draft()
        if self.opts.verify_mode is MtpVerifyMode.BATCH:
            self.begin_verify()
        first = mx.array([x], dtype=mx.uint32)
        if self.host_drafts is not None:
            return mx.array([x, *self.host_drafts], dtype=mx.uint32)[None]
        return mx.concatenate([first, *[d.reshape(1).astype(mx.uint32) for d in self.drafts]])[None]

    def begin_verify(self) -> None:
        for c in self.caches.main:
            if isinstance(c, StepCache):
                if self.opts.rollback == "states":
                    c.recording = True
                else:
                    self.saved.append((c[0], c[1]))

    def verify_tail(self, h: mx.array) -> tuple[np.ndarray, list[int], list[list[int]], mx.array]:
        """Greedy tokens of every verified position (sampling: their distributions [K+1, V]), the drafts,
        their top-k, and the hidden states."""
        if self.opts.sampling:
            p = self.dist(self.model.head(h)[0])
            mx.eval(h, self.drafts, self.topk, [c.state for c in self.caches.main])
            drafts = self.host_drafts if self.host_drafts is not None else [int(d.item()) for d in self.drafts]  # pyright: ignore[reportArgumentType]
            return p, drafts, [np.array(t).tolist() for t in self.topk], h
        # Row by row: the one-token shapes of plain decoding (the same logits, and a faster kernel on CPU).
        am = mx.concatenate([mx.argmax(self.model.head(h[:, i]), axis=-1) for i in range(h.shape[1])])
        mx.eval(am, h, self.drafts, self.topk, [c.state for c in self.caches.main])
        drafts = self.host_drafts if self.host_drafts is not None else [int(d.item()) for d in self.drafts]  # pyright: ignore[reportArgumentType]
        return np.array(am), drafts, [np.array(t).tolist() for t in self.topk], h

    def step_tail(self, h: mx.array) -> tuple[Any, mx.array]:
        """`verify_mode=sequential`: one position's greedy token (sampling: its distribution)."""
        if self.opts.sampling:
            p = self.dist(self.model.head(h[:, -1])[0])
            mx.eval(h, [c.state for c in self.caches.main])
            return p, h
        am = mx.argmax(self.model.head(h[:, -1])[0], axis=-1)
        mx.eval(am, h, self.drafts, self.topk, [c.state for c in self.caches.main])
        return int(am.item()), h  # pyright: ignore[reportArgumentType]

    def host_draft_tokens(self) -> tuple[list[int], list[list[int]]]:
        mx.eval(self.drafts, self.topk)
        drafts = self.host_drafts if self.host_drafts is not None else [int(d.item()) for d in self.drafts]  # pyright: ignore[reportArgumentType]
        return drafts, [np.array(t).tolist() for t in self.topk]

    def rollback(self, drafted: int, accepted: int) -> bool:
        """Main model back to "y_n, d_1 … d_accepted processed"; True when a re-run must follow."""
        rerun = self.opts.rollback == "rerun" and accepted < drafted
        saved = iter(self.saved)
        for c in self.caches.main:
            if isinstance(c, StepCache):
                if rerun:
                    c[0], c[1] = next(saved)
                elif accepted < drafted and c.recording:
                    c.rollback(accepted + 1)
                c.forget()
            elif isinstance(c, ArraysCache):
                raise AssertionError("speculation needs StepCache for Gated DeltaNet layers")
            else:
                c.trim(drafted + 1 if rerun else drafted - accepted)
        self.saved = []
        return rerun

    def apply_pending(self, sync: bool = False) -> None:
        """The last round's rollback (unless done) and MTP repair: draft-time entries replaced by verified rows."""
        p, self.pending = self.pending, None
        if p is None:
            return
        if not p.rolled_back and self.opts.verify_mode is MtpVerifyMode.BATCH:
            self.rollback(p.drafted, p.accepted)
        self.caches.mtp.trim(p.drafted - 1 if p.mtp_trim is None else p.mtp_trim)
        self.mtp_rows(p.hidden[p.row:p.row + 1, :len(p.rows)], p.rows, sync=sync)
        if sync:
            mx.eval([c.state for c in self.caches.main])

    def settle(self, h: mx.array) -> None:
        mx.eval(h, [c.state for c in self.caches.main])

    # -- the head's experts streamed: every MTP call is a step of the forward (qnpipe.model.stepper.MtpRun)

    def mtp_run(self, hidden: mx.array, tokens: Sequence[int], drafter_hidden: bool = False,
                cache: KVCache | None = None) -> MtpRun:
        """An MTP step over rows (hidden[t], tokens[t]), t < len(tokens), on `cache` (default: the real one)."""
        hidden = hidden[:, :len(tokens)]
        feed = hidden if drafter_hidden else self.drafter_input(hidden)
        return MtpRun(self.head, feed, mx.array(list(tokens), dtype=mx.uint32)[None],
                      self.caches.mtp if cache is None else cache)

    def mtp_out(self, value: Any) -> tuple[np.ndarray, mx.array]:
        """A path-drafting MTP step's (last row's logits on the host, the hidden the next step reads)."""
        logits, out, pre = value
        feed = (out if self.opts.hidden is MtpHidden.POST_NORM else pre)[:, -1:]
        last = logits[0, -1].astype(mx.float32)
        mx.eval(last, feed)
        return np.array(last), feed

    def mtp_direct(self, feed: mx.array, token: int, cache: KVCache) -> tuple[np.ndarray, mx.array]:
        """One resident MTP step on `cache` from the drafter's own hidden `feed` and `token`."""
        return self.mtp_out(self.head(self.model, feed, mx.array([[token]], dtype=mx.uint32), cache))

    def pending_logits(self) -> tuple[np.ndarray, mx.array]:
        assert self.logits is not None and self.feed is not None
        return np.array(self.logits.astype(mx.float32)), self.feed

    def tree_tail(self, h: mx.array) -> tuple[np.ndarray, mx.array]:
        am = mx.argmax(self.model.head(h), axis=-1)
        mx.eval(am, h)
        return np.array(am), h

    def mtp_tail(self, value: Any) -> None:
        """The MTP step's (logits, hidden after mtp.norm, before it): the next draft's row."""
        logits, out, pre = value
        self.logits = logits[0, -1]
        self.feed = (out if self.opts.hidden is MtpHidden.POST_NORM else pre)[:, -1:]
        mx.eval(self.logits, self.feed, self.caches.mtp.state)

    def pick(self) -> tuple[int, float]:
        """A draft from the pending row's logits (host): argmax, or drawn (sampling); and its probability."""
        assert self.logits is not None
        o = self.opts
        if o.accept_topk > 0:
            kk = min(o.accept_topk, self.logits.shape[-1])
            self.topk.append(mx.argpartition(-self.logits, kth=kk - 1)[:kk])
        if o.sampling:
            q = self.dist(self.logits)
            self.q.append(q)
            d = draw(q, self.rng)
            return d, float(q[d])
        d = int(mx.argmax(self.logits).item())  # pyright: ignore[reportArgumentType]
        conf = float(mx.softmax(self.logits.astype(mx.float32))[d].item()) if o.adaptive_depth else 1.0  # pyright: ignore[reportArgumentType]
        return d, conf

    def begin_streamed_draft(self) -> None:
        self.drafts, self.topk, self.host_drafts, self.q = [], [], None, []

    def take_pending(self) -> Pending | None:
        """The last round's rollback, applied now; the MTP repair it still needs is returned."""
        p, self.pending = self.pending, None
        if p is not None:
            if not p.rolled_back and self.opts.verify_mode is MtpVerifyMode.BATCH:
                self.rollback(p.drafted, p.accepted)
            self.caches.mtp.trim(p.drafted - 1 if p.mtp_trim is None else p.mtp_trim)
            p.hidden, p.row = p.hidden[p.row:p.row + 1], 0  # a batch verify's committed row
        return p
