"""The MTP speculation loop over the forward actor (docs/model.md, "MTP speculation").

Each round drafts up to K tokens with the MTP head, verifies `[y_n, d_1 … d_K]` in one step
of the main model through `Forward.run` (so a streamed model acquires the union of the
step's experts per layer, split into parts when a layer's capacity is short), keeps the
longest prefix greedy decoding would produce (or what the speculative-sampling rule keeps)
plus the model's own next token, and rolls back: attention caches are trimmed, Gated
DeltaNet layers take the state kept after the last accepted token (`StepCache`), and the
MTP's draft-time cache entries are replaced by rows built from the verified hidden states.
All resident, the drafter's work is fused into the verify step (`SpecState.round_inputs`);
streamed, each MTP call is a step of its own (`MtpRun`); `tree_round` verifies several
draft paths as one batch (qnpipe.live.mtp.tree).

The caches are one list (`SpecCaches.all`): the main model's layers, then the MTP layer's
KV cache, so whatever saves a model cache saves the drafter's with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import trio
from mlx_lm.models.cache import KVCache

from qnpipe.actors.forward import Forward
from qnpipe.actors.stamp import Stamper
from qnpipe.config import MtpHidden, MtpVerifyMode
from qnpipe.live.decoding import conclude
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.mtp.sampling import accept_sampled, draw, judge
from qnpipe.live.mtp.state import Draft, Oracle, Pending, SpecCaches, SpecOptions, SpecState
from qnpipe.live.mtp.stats import SpecStats
from qnpipe.live.mtp.tree import Branch, batch_caches, best_path, copy_kv, take_row
from qnpipe.live.prefix import Plan, PrefixCache
from qnpipe.live.prefix import prefill as open_prefill
from qnpipe.live.session import DecodeSession, Output
from qnpipe.model.mtp import MtpHead
from qnpipe.model.qwen3_next import Model
from qnpipe.model.stepper import MtpRun
from qnpipe.stats import FinishReason, GenerateResult
from qnpipe.trace import SpecRound

__all__ = ["Draft", "MtpHidden", "Oracle", "Pending", "Recorder", "SpecCaches", "SpecOptions", "SpecState",
           "accept_greedy", "catch_up", "commit_round", "generate", "prefill", "spec_round", "tree_round"]


def _ids(tokens: Sequence[int]) -> Callable[[], mx.array]:
    # Built on the MLX thread: an MLX op made on another thread is bound to that thread's stream.
    return lambda: mx.array(list(tokens), dtype=mx.uint32)[None]


async def generate(fwd: Forward, thread: MLXThread, model: Model, head: MtpHead, tokenizer: Any,
                   tokens: Sequence[int], *, max_tokens: int, eos: set[int], chunk: int, opts: SpecOptions,
                   on_text: Callable[[str], None] | None = None,
                   on_prefill: Callable[[int, int], None] | None = None,
                   partial: list[int] | None = None, prefix: PrefixCache | None = None) -> GenerateResult:
    """Greedy generation with MTP speculation: the same tokens as plain greedy decoding, fewer steps.

    `prefix` resumes the prompt from a kept state of both models and keeps new ones (qnpipe.live.prefix)."""
    t0 = trio.current_time()
    st = await run_on(thread, SpecState, model, head, opts)
    pf = await open_prefill(thread, tokens, chunk, prefix, on_prefill)
    session = DecodeSession(Output(tokenizer, eos, on_text, partial), len(tokens), max_tokens, t0, pf.start)
    x = await prefill(fwd, thread, st, tokens, chunk, on_prefill, prefix, pf.plan)
    rec = Recorder(opts.max_depth)
    pending = [x]
    while session.commit(pending, trio.current_time()):
        pending = await spec_round(fwd, thread, st, pending[-1], session.kept, opts, rec)
    if opts.mtp_streamed:  # leave the caches at the committed tokens
        p = await run_on(thread, st.take_pending)
        if p is not None:
            await fwd.run(_mtp_input(st, p.hidden, p.rows), None, st.mtp_tail)
    else:
        await run_on(thread, st.apply_pending, True)
    return await conclude(thread, session, mtp=rec.stats())


async def prefill(fwd: Forward, thread: MLXThread, st: SpecState, tokens: Sequence[int], chunk: int,
                  on_prefill: Callable[[int, int], None] | None = None, prefix: PrefixCache | None = None,
                  plan: Plan | None = None) -> int:
    """The prompt through the main model and the MTP over its rows, span by span; returns the first new token.

    Row j pairs h_j with token j+1, the last row with the new token. Each span's rows are one MTP
    piece, run right after the span (its last row's token is the next span's first), so the caches
    at a span end cover both models there: a prefix snapshot (`plan`, qnpipe.live.prefix) taken or
    resumed at it leaves the same pieces to compute as a prefill from the start.
    """
    pf = await open_prefill(thread, tokens, chunk, prefix, on_prefill, plan)
    await pf.restore(st.resume, st.caches.all)
    x = -1
    for lo, hi, last in pf.spans():
        if last:
            x, h = await fwd.run(_ids(tokens[lo:hi]), st.caches.main, st.first_token)
        else:
            h = await fwd.run(_ids(tokens[lo:hi]), st.caches.main, st.hidden_tail)
        nxt = [*tokens[lo + 1:hi], x] if last else list(tokens[lo + 1:hi + 1])
        if st.opts.mtp_streamed:
            await fwd.run(_mtp_input(st, h, nxt), None, st.mtp_tail)
        else:
            await run_on(thread, catch_up, st, [h], nxt, 0)
        await pf.reached(hi, st.caches.all)
    return x


def _mtp_input(st: SpecState, hidden: mx.array, tokens: Sequence[int],
               drafter_hidden: bool = False) -> Callable[[], MtpRun]:
    return lambda: st.mtp_run(hidden, tokens, drafter_hidden)


async def streamed_drafts(fwd: Forward, thread: MLXThread, st: SpecState) -> None:
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


def commit_round(output: Output, pending: Sequence[int], n: int, max_tokens: int) -> tuple[int, FinishReason | None]:
    """Commit a round's tokens: (tokens committed so far, why generation ends: EOS or LENGTH, else None).
    Kept for its callers; the loops use `DecodeSession.commit`, the same rule."""
    session = DecodeSession(output, 0, max_tokens, 0.0)
    session.n = n
    session.commit(pending, 0.0)
    return session.n, session.reason


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

    def round(self, drafts: Draft, main: Sequence[int] | np.ndarray, a: int) -> None:
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
    """A round over several draft paths verified as one batch (greedy; qnpipe.live.mtp.tree)."""
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
    st.pending = Pending(K, a, h, committed, rolled_back=True, mtp_trim=0, row=j)
    rec.round(Draft(paths[j], []), main[j], a)
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
        await streamed_drafts(fwd, thread, st)
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
        await streamed_drafts(fwd, thread, st)
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
    st.pending = Pending(K, a, h, committed)
    if opts.verify_mode is MtpVerifyMode.BATCH and opts.rollback == "rerun" and a < K:
        st.pending.rolled_back = await run_on(thread, st.rollback, K, a)
        await fwd.run(_ids([x, *drafts[:a]]), st.caches.main, st.settle)
    t3 = trio.current_time()
    rec.round(Draft(drafts, topk), main, a)
    if opts.emit is not None:
        opts.emit(SpecRound(**rec.stamper.stamp(), step=fwd.stats.steps, drafts=tuple(drafts), accepted=a,
                           bonus=committed[-1]))
    rec.draft_s += t1 - t0 if opts.verify_mode is not MtpVerifyMode.BATCH else 0.0
    rec.verify_s += t2 - t1 if opts.verify_mode is not MtpVerifyMode.BATCH else t1 - t0
    rec.rollback_s += t3 - t2
    return committed
