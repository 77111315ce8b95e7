"""The greedy MTP speculation loop over the forward actor (docs/model.md, "MTP speculation").

Each round drafts up to K tokens with the MTP head (MLX thread, resident), verifies
`[y_n, d_1 … d_K]` in one step of the main model through `Forward.run` (so a streamed
model acquires the union of the step's experts per layer, split into parts when a layer's
capacity is short), accepts the longest prefix greedy decoding would produce plus the
model's own next token, and rolls back: attention caches are trimmed, Gated DeltaNet
layers take the state kept after the last accepted token (`StepCache`), and the MTP's
draft-time cache entries are replaced by rows built from the verified hidden states.

The caches are one list (`SpecCaches.all`): the main model's layers, then the MTP layer's
KV cache, so whatever saves a model cache saves the drafter's with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import trio
from mlx_lm.models.cache import ArraysCache, KVCache

from qnpipe.actors.forward import Forward
from qnpipe.actors.stamp import Stamper
from qnpipe.config import MtpHidden, MtpVerifyMode
from qnpipe.messages import Msg
from qnpipe.mlx_thread import MLXThread, run_on
from qnpipe.model.decode import chunks
from qnpipe.model.mtp import MtpHead
from qnpipe.model.qwen3_next import Model
from qnpipe.model.step_cache import StepCache
from qnpipe.model.stepper import MtpRun
from qnpipe.spec.sampling import accept_sampled, draw, judge, probs
from qnpipe.spec.stats import SpecStats
from qnpipe.spec.tree import Branch, batch_caches, best_path, copy_kv, take_row
from qnpipe.stats import FinishReason, GenerateResult, GenerateStats
from qnpipe.trace import SpecRound

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
    branches: tuple[Branch, ...] = ()  # extra draft paths verified as one batch (qnpipe.spec.tree)
    temperature: float = 0.0  # > 0: speculative sampling (qnpipe.spec.sampling)
    top_p: float = 1.0
    seed: int | None = None

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
class _Draft:
    tokens: list[int]
    topk: list[list[int]]


@attrs.define
class _Pending:
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
        self.pending: _Pending | None = None
        self.drafts: list[mx.array] = []
        self.topk: list[mx.array] = []
        self.host_drafts: list[int] | None = None
        self.q: list[np.ndarray] = []  # sampling: the distribution each draft was drawn from
        self.rng = np.random.default_rng(opts.seed)
        self.done = 0  # tokens generated before this round (the oracle's index)

    def dist(self, logits: mx.array) -> np.ndarray:
        """Sampling: the distribution plain sampling draws from (host, float64)."""
        return probs(np.array(logits.astype(mx.float32)), self.opts.temperature, self.opts.top_p)

    def drafter_input(self, h: mx.array) -> mx.array:
        """The main model's hidden as the drafter reads it (`mtp.hidden`).

        The forward yields post-norm states x̂ = x / rms(x) ⊙ w; x̂ ⊘ w is the pre-norm x up
        to its per-row scale, which the drafter's first RMSNorm removes.
        """
        if self.opts.hidden is MtpHidden.POST_NORM:
            return h
        w = self.model.model.norm.weight
        return h / mx.where(w == 0, 1, w)

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
            logits, out, pre = self.head(self.model, feed[:, lo:hi], toks[:, lo:hi], self.caches.mtp)
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

    def take_pending(self) -> _Pending | None:
        """The last round's rollback, applied now; the MTP repair it still needs is returned."""
        p, self.pending = self.pending, None
        if p is not None:
            if not p.rolled_back and self.opts.verify_mode is MtpVerifyMode.BATCH:
                self.rollback(p.drafted, p.accepted)
            self.caches.mtp.trim(p.drafted - 1 if p.mtp_trim is None else p.mtp_trim)
            p.hidden, p.row = p.hidden[p.row:p.row + 1], 0  # a batch verify's committed row
        return p


def _ids(tokens: Sequence[int]) -> Callable[[], mx.array]:
    # Built on the MLX thread: an MLX op made on another thread is bound to that thread's stream.
    return lambda: mx.array(list(tokens), dtype=mx.uint32)[None]


async def generate(fwd: Forward, thread: MLXThread, model: Model, head: MtpHead, tokenizer: Any,
                   tokens: Sequence[int], *, max_tokens: int, eos: set[int], chunk: int, opts: SpecOptions,
                   on_text: Callable[[str], None] | None = None,
                   on_prefill: Callable[[int, int], None] | None = None,
                   partial: list[int] | None = None) -> GenerateResult:
    """Greedy generation with MTP speculation: the same tokens as plain greedy decoding, fewer steps."""
    t0 = trio.current_time()
    st = await run_on(thread, SpecState, model, head, opts)
    x = await prefill(fwd, thread, st, tokens, chunk, on_prefill)
    t_first = trio.current_time()
    detok = tokenizer.detokenizer if tokenizer is not None else None
    if detok is not None:
        detok.reset()
    out: list[int] = [] if partial is None else partial
    reason = FinishReason.LENGTH
    n = 0
    rec = Recorder(opts.max_depth)
    pending = [x]
    while True:
        for tok in pending:  # commit: stop at EOS or max_tokens
            n += 1
            if tok in eos:
                reason = FinishReason.EOS
                break
            out.append(tok)
            if detok is not None:
                detok.add_token(tok)
                if on_text is not None and (seg := detok.last_segment):
                    on_text(seg)
            if n >= max_tokens:
                break
        if n >= max_tokens or reason is FinishReason.EOS:
            break
        x = pending[-1]
        pending = await spec_round(fwd, thread, st, x, len(out), opts, rec)
    if opts.mtp_streamed:  # leave the caches at the committed tokens
        p = await run_on(thread, st.take_pending)
        if p is not None:
            await fwd.run(_mtp_input(st, p.hidden, p.rows), None, st.mtp_tail)
    else:
        await run_on(thread, st.apply_pending, True)
    t_end = trio.current_time()
    text = ""
    if detok is not None:
        detok.finalize()
        if on_text is not None and (seg := detok.last_segment):
            on_text(seg)
        text = detok.text
    prefill_s = t_first - t0
    decode_s = t_end - t_first
    peak = await run_on(thread, mx.get_peak_memory)
    stats = GenerateStats(
        prompt_tokens=len(tokens), generated_tokens=n, prefill_s=prefill_s, decode_s=decode_s,
        prefill_tok_s=len(tokens) / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=(n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0,
        peak_memory_bytes=int(peak), finish_reason=reason, mtp=rec.stats())
    return GenerateResult(tokens=tuple(out), text=text, stats=stats)


async def prefill(fwd: Forward, thread: MLXThread, st: SpecState, tokens: Sequence[int], chunk: int,
                  on_prefill: Callable[[int, int], None] | None = None) -> int:
    """The prompt through the main model, then the MTP over its rows; returns the first new token."""
    spans = chunks(len(tokens), chunk)
    hiddens: list[mx.array] = []
    x = -1
    for i, (lo, hi) in enumerate(spans):
        if i == len(spans) - 1:
            x, h = await fwd.run(_ids(tokens[lo:hi]), st.caches.main, st.first_token)
        else:
            h = await fwd.run(_ids(tokens[lo:hi]), st.caches.main, st.hidden_tail)
        hiddens.append(h)
        if on_prefill is not None:
            on_prefill(hi, len(tokens))
    # Row j pairs h_j with token j+1, the last row with the new token.
    if st.opts.mtp_streamed:
        nxt = [*tokens[1:], x]
        for (lo, hi), h in zip(spans, hiddens, strict=True):
            await fwd.run(_mtp_input(st, h, nxt[lo:hi]), None, st.mtp_tail)
    else:
        await run_on(thread, catch_up, st, hiddens, [*tokens[1:], x], chunk)
    return x


def _mtp_input(st: SpecState, hidden: mx.array, tokens: Sequence[int],
               drafter_hidden: bool = False) -> Callable[[], MtpRun]:
    return lambda: st.mtp_run(hidden, tokens, drafter_hidden)


async def _streamed_drafts(fwd: Forward, thread: MLXThread, st: SpecState) -> None:
    """The previous round's MTP repair and this round's drafts, each MTP call a step through the pool."""
    p = await run_on(thread, st.take_pending)
    if p is not None:
        await fwd.run(_mtp_input(st, p.hidden, p.rows), None, st.mtp_tail)
    await run_on(thread, st.begin_streamed_draft)
    o = st.opts
    tokens: list[int] = []
    conf = 1.0
    while True:
        d, p_d = await run_on(thread, st.pick)
        tokens.append(d)
        conf *= p_d
        if len(tokens) >= o.max_depth or (o.adaptive_depth and conf < o.conf_tau):
            break
        assert st.feed is not None
        await fwd.run(_mtp_input(st, st.feed, [d], drafter_hidden=True), None, st.mtp_tail)
    if o.oracle is not None:
        tokens = o.oracle(st.done, tokens)
    st.host_drafts = tokens


def catch_up(st: SpecState, hiddens: list[mx.array], next_tokens: list[int], chunk: int) -> None:
    st.mtp_rows(mx.concatenate(hiddens, axis=1) if len(hiddens) > 1 else hiddens[0], next_tokens, chunk)


class Recorder:
    """Accumulates a generate call's SpecStats (trio side)."""

    def __init__(self, depth: int) -> None:
        self.rounds = self.tokens = self.splits = self.rescues = 0
        self.hist = [0] * (depth + 1)
        self.drafted = [0] * depth
        self.accepted = [0] * depth
        self.topk = [0] * depth
        self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.stamper = Stamper()

    def round(self, drafts: _Draft, main: Sequence[int] | np.ndarray, a: int) -> None:
        self.rounds += 1
        self.tokens += a + 1
        self.hist[a] += 1
        for i in range(len(drafts.tokens)):
            self.drafted[i] += 1
            self.accepted[i] += i < a
        for i, top in enumerate(drafts.topk[:len(main)]):
            self.topk[i] += int(main[i]) in top

    def stats(self) -> SpecStats:
        return SpecStats.build(rescues=self.rescues, rounds=self.rounds, tokens=self.tokens, accept_hist=tuple(self.hist),
                         drafted_at=tuple(self.drafted), accepted_at=tuple(self.accepted),
                         topk_hits=tuple(self.topk) if any(self.topk) else (),
                         capacity_split_verifies=self.splits, draft_s=self.draft_s, verify_s=self.verify_s,
                         rollback_s=self.rollback_s)


def accept_greedy(drafts: Sequence[int], main: Sequence[int]) -> int:
    """The number of leading drafts equal to the main model's greedy token before them."""
    a = 0
    while a < len(drafts) and drafts[a] == int(main[a]):
        a += 1
    return a


async def _repair(fwd: Forward, thread: MLXThread, st: SpecState) -> None:
    """The previous round's rollback (if still due) and MTP repair, synchronously."""
    p = await run_on(thread, st.take_pending)
    if p is None:
        return
    if st.opts.mtp_streamed:
        await fwd.run(_mtp_input(st, p.hidden, p.rows), None, st.mtp_tail)
    else:
        await run_on(thread, st.mtp_rows, p.hidden, p.rows)


async def _draft_path(fwd: Forward, thread: MLXThread, st: SpecState, branch: Branch | None,
                      depth: int | None) -> list[int]:
    """One draft path on a copy of the MTP cache: greedy, except `branch`'s position; `depth` None =
    the configured depth (adaptive when `mtp.adaptive_depth`)."""
    o = st.opts
    cache = await run_on(thread, copy_kv, st.caches.mtp)
    logits, feed = await run_on(thread, st.pending_logits)
    limit = depth if depth is not None else o.max_depth
    tokens: list[int] = []
    conf = 1.0
    while True:
        i = len(tokens)
        tok = int(np.argsort(-logits, kind="stable")[branch.rank]) if branch is not None and i == branch.pos \
            else int(logits.argmax())
        tokens.append(tok)
        if depth is None and o.adaptive_depth:
            e = np.exp(logits - logits.max())
            conf *= float(e[tok] / e.sum())
            if conf < o.conf_tau:
                break
        if len(tokens) >= limit:
            break
        if o.mtp_streamed:
            logits, feed = await fwd.run(_mtp_path_input(st, feed, tok, cache), None, st.mtp_out)
        else:
            logits, feed = await run_on(thread, st.mtp_direct, feed, tok, cache)
    return tokens


def _mtp_path_input(st: SpecState, feed: mx.array, tok: int, cache: KVCache) -> Callable[[], MtpRun]:
    return lambda: st.mtp_run(feed, [tok], True, cache)


async def tree_round(fwd: Forward, thread: MLXThread, st: SpecState, x: int, done: int, opts: SpecOptions,
                     rec: Recorder) -> list[int]:
    """A round over several draft paths verified as one batch (greedy; qnpipe.spec.tree)."""
    t0 = trio.current_time()
    st.done = done
    await _repair(fwd, thread, st)
    paths = [await _draft_path(fwd, thread, st, None, None)]
    K = len(paths[0])
    paths += [await _draft_path(fwd, thread, st, b, K) for b in opts.branches if b.pos < K]
    t1 = trio.current_time()
    splits0 = fwd.stats.split_layer_steps
    big = await run_on(thread, batch_caches, st.caches.main, len(paths))
    rows = [[x, *p] for p in paths]
    main, h = await fwd.run(lambda: mx.array(rows, dtype=mx.uint32), big, st.tree_tail)
    rec.splits += fwd.stats.split_layer_steps > splits0
    t2 = trio.current_time()
    j, a = best_path(paths, main)
    committed = [*paths[j][:a], int(main[j, a])]
    await run_on(thread, take_row, st.caches.main, big, j, a + 1)
    st.pending = _Pending(K, a, h, committed, rolled_back=True, mtp_trim=0, row=j)
    rec.round(_Draft(paths[j], []), main[j], a)
    rec.rescues += j != 0
    if opts.emit is not None:
        opts.emit(SpecRound(**rec.stamper.stamp(), step=fwd.stats.steps, drafts=tuple(paths[j]), accepted=a,
                            bonus=committed[-1]))
    rec.draft_s += t1 - t0
    rec.verify_s += t2 - t1
    rec.rollback_s += trio.current_time() - t2
    return committed


async def spec_round(fwd: Forward, thread: MLXThread, st: SpecState, x: int, done: int, opts: SpecOptions,
                 rec: Recorder) -> list[int]:
    """One draft / verify / rollback round after the pending token `x`; returns the committed tokens."""
    if opts.branches and not opts.sampling:
        return await tree_round(fwd, thread, st, x, done, opts, rec)
    t0 = t1 = t2 = trio.current_time()
    st.done = done
    splits0 = fwd.stats.split_layer_steps
    if opts.verify_mode is MtpVerifyMode.BATCH and opts.mtp_streamed:
        await _streamed_drafts(fwd, thread, st)
        rec.draft_s += trio.current_time() - t0
        t0 = trio.current_time()
        await run_on(thread, st.begin_verify)
        assert st.host_drafts is not None
        main, drafts, topk, h = await fwd.run(_ids([x, *st.host_drafts]), st.caches.main, st.verify_tail)
    elif opts.verify_mode is MtpVerifyMode.BATCH:
        main, drafts, topk, h = await fwd.run(lambda: st.round_inputs(x), st.caches.main, st.verify_tail)
    if opts.verify_mode is MtpVerifyMode.BATCH:
        if opts.sampling:
            a, bonus = accept_sampled(drafts, np.stack(st.q), main, st.rng)
            main = np.array([*drafts[:a], bonus])
        else:
            a = accept_greedy(drafts, main)
        t1 = t2 = trio.current_time()
    elif opts.mtp_streamed:
        await _streamed_drafts(fwd, thread, st)
        drafts, topk = await run_on(thread, st.host_draft_tokens)
    else:
        await run_on(thread, st.apply_pending)
        await run_on(thread, st.draft)
        drafts, topk = await run_on(thread, st.host_draft_tokens)
    if opts.verify_mode is not MtpVerifyMode.BATCH:
        t1 = trio.current_time()
        main_l: list[int] = []
        hs: list[mx.array] = []
        tok = x
        for i in range(len(drafts) + 1):
            m, hi = await fwd.run(_ids([tok]), st.caches.main, st.step_tail)
            hs.append(hi)
            if opts.sampling:  # m: this position's distribution
                r = draw(m, st.rng) if i == len(drafts) else judge(drafts[i], st.q[i], m, st.rng)
                main_l.append(drafts[i] if r is None else r)
                if r is not None:
                    break
            else:
                main_l.append(m)
                if i == len(drafts) or drafts[i] != m:
                    break
            tok = drafts[i]
        main = np.array(main_l)
        a = len(main_l) - 1
        h = await run_on(thread, mx.concatenate, hs, 1) if len(hs) > 1 else hs[0]
        t2 = trio.current_time()
    rec.splits += fwd.stats.split_layer_steps > splits0
    K = len(drafts)
    committed = [*drafts[:a], int(main[a])]
    st.pending = _Pending(K, a, h, committed)
    if opts.verify_mode is MtpVerifyMode.BATCH and opts.rollback == "rerun" and a < K:
        st.pending.rolled_back = await run_on(thread, st.rollback, K, a)
        await fwd.run(_ids([x, *drafts[:a]]), st.caches.main, st.settle)
    t3 = trio.current_time()
    rec.round(_Draft(drafts, topk), main, a)
    if opts.emit is not None:
        opts.emit(SpecRound(**rec.stamper.stamp(), step=fwd.stats.steps, drafts=tuple(drafts), accepted=a,
                           bonus=committed[-1]))
    rec.draft_s += t1 - t0 if opts.verify_mode is not MtpVerifyMode.BATCH else 0.0
    rec.verify_s += t2 - t1 if opts.verify_mode is not MtpVerifyMode.BATCH else t1 - t0
    rec.rollback_s += t3 - t2
    return committed
