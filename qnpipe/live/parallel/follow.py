"""The ranks after rank 0: take a step from the previous rank, run it through this rank's layers
(its own forward, pool and actors), hand the result on, until rank 0 stops the ring.

The last rank runs the step's tail (qnpipe.model.tails: the final norm and LM head, logits or a
sampled token) and sends its value to rank 0, so one step is one pass around the ring. With MTP
speculation it also runs the MTP head (`_Sequence.spec`): it drafts, accepts and answers with the
committed tokens and the next drafts; every rank rolls its own layers back (`Verifying`). When
the experts stream, the head's MoE is a layer of the last rank's pool, as in one process: its
MTP calls are forward steps of their own (`_mtp_streamed`), run before the answer is sent.
Between steps it keeps, restores and drops its own layers' prefix snapshots as rank 0 says
(`_snapshot`, qnpipe.live.parallel.snap).
"""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from qnpipe.actors.forward import Forward
from qnpipe.errors import DistributedError, SnapshotError
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.mtp.loop import accept_greedy, streamed_drafts
from qnpipe.live.mtp.sampling import accept_sampled
from qnpipe.live.mtp.state import SpecOptions, SpecState
from qnpipe.live.parallel.ring import SNAP_WORDS, Header, Op, Ring, SnapAction, dtype_code
from qnpipe.live.parallel.snap import DISK, HEAD, RankStates, SnapWords, decode, encode
from qnpipe.live.parallel.verify import Verifying, own_layers, spec_cache, spec_restore
from qnpipe.live.prefix import SnapshotFileWarning
from qnpipe.model.qwen3_next import Model
from qnpipe.model.snapshots import Snapshot, restore
from qnpipe.model.tails import Logits, Sampling, Settle, TailKind

_MTP = (TailKind.MTP_SETTLE, TailKind.MTP_FIRST, TailKind.MTP_VERIFY)


class _Sequence:
    """One sequence's state on this rank: its cache and, on the last rank, its sampler or its MTP state."""

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.sampling: Sampling | None = None
        self.spec: SpecState | None = None
        self.verifying: Verifying | None = None
        self.drafts: list[int] = []  # the last rank: the drafts rank 0 verifies next
        # The last rank, the head's experts streamed: this step's MTP rows (hidden, next tokens) and the
        # tokens it commits (None: a settle step), run as steps of their own before the answer goes.
        self.later: tuple[mx.array, list[int], list[int] | None] | None = None
        # Resumed from a prefix snapshot: the sampler comes with the sequence's first step.
        self.sampler_due = False

    @classmethod
    def start(cls, model: Model, header: Header, head: Any, mtp_opts: SpecOptions) -> _Sequence:
        """A new sequence for the step `header`: its first."""
        if header.kind not in _MTP:
            return cls(model.make_cache())
        if head is not None:
            spec = SpecState(model, head, _with_sampler(mtp_opts, header))
            seq = cls(spec.caches.main)
            seq.spec = spec
        else:
            seq = cls(spec_cache(model))
        seq.verifying = Verifying(model, seq.cache)
        return seq

    @classmethod
    def resumed(cls, model: Model, snap: Snapshot, depth: int, head: Any, mtp_opts: SpecOptions) -> _Sequence:
        """A new sequence in the state of this rank's prefix snapshot `snap` (`depth` > 0: an MTP one).
        SnapshotError when it does not fit this rank's caches."""
        if depth == 0:
            return cls(restore(snap))
        if head is not None:  # the last rank: its state ends with its MTP layer's
            spec = SpecState(model, head, attrs.evolve(mtp_opts, k=depth))
            spec.resume(snap)
            seq = cls(spec.caches.main)
            seq.spec = spec
            seq.sampler_due = True
        else:
            seq = cls(spec_restore(model, snap))
        seq.verifying = Verifying(model, seq.cache)
        return seq

    def own(self, model: Model) -> list[Any]:
        """This rank's caches as a prefix snapshot holds them (with MTP, the last rank's MTP layer's too)."""
        return own_layers(model, self.spec.caches.all if self.spec is not None else self.cache)


def _receive(ring: Ring, hidden: int) -> tuple[Header, mx.array | None, list[int]]:
    while True:  # each wait bounded by the step timeout: an idle rank 0 keeps it alive with PINGs
        header, h = ring.recv(ring.prev, lambda hd: (SNAP_WORDS,) if hd.op is Op.SNAP else (1, hd.rows, hidden))
        if header.op is not Op.PING:
            break
        if ring.next != 0:  # passed on to the last rank, never back to rank 0 (it reads only answers)
            ring.send(header, None, ring.next)
    ids = np.array(ring.recv_ids(ring.prev, header.ids)).tolist() if header.op is Op.STEP and header.ids else []
    return header, h, ids


async def follow(fwd: Forward, thread: MLXThread, model: Model, ring: Ring, states: RankStates, head: Any = None,
                 mtp_opts: SpecOptions | None = None) -> None:
    """Serve rank 0's steps until it stops the ring; DistributedError naming the rank that was lost.

    `states`: this rank's prefix snapshots. `head`: the MTP head (the last rank of an MTP engine);
    `mtp_opts`: how it drafts (`mtp.hidden`, adaptive depth, whether its experts come from this rank's
    pool), a step's header giving K and the sampler."""
    opts = mtp_opts if mtp_opts is not None else SpecOptions()
    hidden = model.args.hidden_size
    seq: _Sequence | None = None
    while True:
        try:
            header, h, ids = await run_on(thread, _receive, ring, hidden)
        except DistributedError:
            if ring.next != ring.prev:  # the next rank still listens: tell it who was lost
                await run_on(thread, ring.tell_lost, ring.prev, ring.next)
            raise
        if header.op is Op.STOP:
            await run_on(thread, ring.send, Header(Op.STOP), None, ring.next)  # the last rank: to rank 0, done
            return
        if header.op is Op.FAIL:
            await run_on(thread, ring.tell_lost, header.rows, ring.next)
            assert ring.broken is not None
            raise ring.broken
        if header.op is Op.SNAP:
            assert h is not None
            seq = await run_on(thread, _snapshot, ring, states, model, seq, header, h, head, opts)
            continue
        if header.op is not Op.STEP:
            raise DistributedError(f"rank {ring.rank}: rank {ring.prev} sent {header.op.name} where a step was due")
        if header.fresh or seq is None:
            seq = await run_on(thread, _Sequence.start, model, header, head, opts)
        elif seq.sampler_due and seq.spec is not None:
            seq.spec.opts = _with_sampler(seq.spec.opts, header)
            seq.spec.rng = np.random.default_rng(seq.spec.opts.seed)
        seq.sampler_due = False
        if (header.kind in _MTP) != (seq.verifying is not None):
            raise DistributedError(f"rank {ring.rank}: a {TailKind(header.kind).name} step in a sequence "
                                   f"that did not start as one")
        if header.kind in _MTP and ring.rank == ring.size - 1 and seq.spec is None:
            raise DistributedError(f"rank {ring.rank}: an MTP step, and this rank has no MTP head "
                                   f"(mtp.enabled must be the same on every rank)")
        assert h is not None
        tail = (_last_tail(ring, model, seq, header, ids) if ring.rank == ring.size - 1
                else _pass_on(ring, seq, header, ids))
        await fwd.run(_given(h, seq, header), seq.cache, tail)
        if seq.later is not None:
            await _mtp_streamed(fwd, thread, ring, seq, header)


def _snapshot(ring: Ring, states: RankStates, model: Model, seq: _Sequence | None, header: Header,
              payload: mx.array, head: Any, mtp_opts: SpecOptions) -> _Sequence | None:
    """Rank 0's prefix snapshot message (qnpipe.live.parallel.snap) on this rank; the sequence after it."""
    words = np.array(payload)
    msg = decode(words)
    last = ring.rank == ring.size - 1
    match SnapAction(header.kind):
        case SnapAction.RESTORE:  # round the ring: the last rank's copy is rank 0's answer
            snap = states.find(msg.key, header.rows, bool(msg.flags & DISK))
            resumed = None
            if snap is not None:
                try:
                    resumed = _Sequence.resumed(model, snap, header.depth, head, mtp_opts)
                except SnapshotError as e:
                    warnings.warn(f"rank {ring.rank}: prefix snapshot not restored: {e}", SnapshotFileWarning,
                                  stacklevel=2)
            if resumed is not None:
                seq = resumed
            elif msg.lacking < 0:
                words = encode(SnapWords(msg.key, msg.flags, ring.rank))
            ring.send(header, mx.array(words), ring.next)
        case SnapAction.CAPTURE:
            if not last:
                ring.send(header, payload, ring.next)
            states.capture(None if seq is None else seq.own(model), msg.key, header.rows, bool(msg.flags & HEAD))
        case SnapAction.DROP:
            if not last:
                ring.send(header, payload, ring.next)
            states.drop(msg.key)
    return seq


def _given(h: mx.array, seq: _Sequence, header: Header) -> Any:
    def inputs() -> mx.array:
        if seq.verifying is not None:  # the last verify step's rollback, before this step runs
            seq.verifying.before(header.keep, header.rows if header.kind == TailKind.MTP_VERIFY else 0)
        return h

    return inputs


def _pass_on(ring: Ring, seq: _Sequence, header: Header, ids: list[int]) -> Any:
    def tail(h: mx.array) -> None:
        ring.send(Header(Op.STEP, rows=header.rows, kind=header.kind, fresh=header.fresh, dtype=dtype_code(h),
                         seed=header.seed, temperature=header.temperature, top_p=header.top_p, ids=header.ids,
                         keep=header.keep, depth=header.depth), h, ring.next)
        if ids:
            ring.send_ids(mx.array(ids, dtype=mx.uint32), ring.next)
        if header.kind in (TailKind.SETTLE, TailKind.MTP_SETTLE):
            mx.eval([c.state for c in seq.cache if c is not None])

    return tail


async def _mtp_streamed(fwd: Forward, thread: MLXThread, ring: Ring, seq: _Sequence, header: Header) -> None:
    """The last rank's MTP work on a step when the head's experts stream (`_Sequence.later`), then the answer."""
    spec = seq.spec
    assert spec is not None and seq.later is not None
    h, rows, committed = seq.later
    seq.later = None
    await fwd.run(lambda: spec.mtp_run(h, rows), None, spec.mtp_tail)
    value = None
    if committed is not None:
        await streamed_drafts(fwd, thread, spec)
        seq.drafts = await run_on(thread, lambda: spec.host_draft_tokens()[0])
        value = _with_drafts(committed, seq.drafts)
    await run_on(thread, _answer, ring, header, value)


def _answer(ring: Ring, header: Header, value: mx.array | None) -> None:
    """A step's value (None: a settle step) to rank 0."""
    ring.send(Header(Op.RESULT, rows=header.rows if value is None or header.kind not in _MTP else value.size,
                     kind=header.kind, dtype=-1 if value is None else dtype_code(value)), value, ring.next)


def _with_drafts(committed: list[int], drafts: list[int]) -> mx.array:
    """An MTP step's answer: the committed tokens, the next drafts and their number (adaptive depth varies it)."""
    return mx.array([*committed, *drafts, len(drafts)], dtype=mx.uint32)


def _drafts(spec: SpecState) -> list[int]:
    spec.draft()
    return spec.host_draft_tokens()[0]


def _mtp_value(seq: _Sequence, header: Header, ids: list[int], h: mx.array) -> mx.array | None:
    """The last rank's MTP work on a step; the token ids rank 0 gets back (None: a settle step, or
    the head's experts stream and `seq.later` holds what is left to run)."""
    spec = seq.spec
    assert spec is not None
    streamed = spec.opts.mtp_streamed
    match header.kind:
        case TailKind.MTP_SETTLE:  # row j pairs h_j with token j + 1 (qnpipe.live.mtp.loop.prefill)
            mx.eval(h, [c.state for c in seq.cache])
            if streamed:
                seq.later = (h, ids, None)
            else:
                spec.mtp_rows(h, ids)
            return None
        case TailKind.MTP_FIRST:  # greedy, or drawn with the sequence's generator (speculative sampling)
            x, _ = spec.first_token(h)
            if streamed:
                seq.later = (h, [*ids, x], [x])
                return None
            spec.mtp_rows(h, [*ids, x])
            seq.drafts = _drafts(spec)
            return _with_drafts([x], seq.drafts)
        case _:  # MTP_VERIFY: as one process's batch verify (loop.spec_round), then the repair and drafts
            main, _, _, _ = spec.verify_tail(h)
            drafted = seq.drafts
            if spec.opts.sampling:  # main: each row's distribution
                a, bonus = accept_sampled(drafted, np.stack(spec.q), main, spec.rng)
            else:
                a = accept_greedy(drafted, main.tolist())
                bonus = int(main[a])
            committed = [*drafted[:a], bonus]
            spec.caches.mtp.trim(len(drafted) - 1)
            if streamed:
                seq.later = (h[:, :a + 1], committed, committed)
                return None
            spec.mtp_rows(h[:, :a + 1], committed, sync=False)
            seq.drafts = _drafts(spec)
            return _with_drafts(committed, seq.drafts)


def _last_tail(ring: Ring, model: Model, seq: _Sequence, header: Header, ids: list[int]) -> Any:
    def tail(h: mx.array) -> None:
        value: mx.array | None
        match header.kind:
            case TailKind.SETTLE:
                Settle(seq.cache)(h)
                value = None
            case TailKind.MTP_SETTLE | TailKind.MTP_FIRST | TailKind.MTP_VERIFY:
                value = _mtp_value(seq, header, ids, h)
            case TailKind.LOGITS | TailKind.LAST_LOGITS:
                value = mx.array(Logits(model, last_only=header.kind == TailKind.LAST_LOGITS)(h))
            case TailKind.SAMPLE:
                if seq.sampling is None:  # seeded as its sequence's first token is drawn, as in one process
                    seq.sampling = Sampling(model, seq.cache, header.temperature, header.top_p,
                                            None if header.seed < 0 else header.seed)
                value = seq.sampling.next_token(h).reshape(1)
            case _:
                raise DistributedError(f"rank {ring.rank}: unknown step end {header.kind}")
        if seq.later is None:  # else `_mtp_streamed` answers
            _answer(ring, header, value)

    return tail


def _with_sampler(opts: SpecOptions, header: Header) -> SpecOptions:
    """`opts` with the sampler a step's header carries (temperature 0: greedy)."""
    return attrs.evolve(opts, k=header.depth, temperature=header.temperature, top_p=header.top_p,
                        seed=None if header.seed < 0 else header.seed)
