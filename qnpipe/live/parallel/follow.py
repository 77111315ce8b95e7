"""The ranks after rank 0: take a step from the previous rank, run it through this rank's layers
(its own forward, pool and actors), hand the result on, until rank 0 stops the ring.

The last rank runs the step's tail (qnpipe.model.tails: the final norm and LM head, logits or a
sampled token) and sends its value to rank 0, so one step is one pass around the ring.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from qnpipe.actors.forward import Forward
from qnpipe.errors import DistributedError
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.parallel.ring import Header, Op, Ring, dtype_code
from qnpipe.model.qwen3_next import Model
from qnpipe.model.tails import Logits, Sampling, Settle, TailKind


class _Sequence:
    """One sequence's state on this rank: its cache and, on the last rank, its sampler."""

    def __init__(self, model: Model) -> None:
        self.cache = model.make_cache()
        self.sampling: Sampling | None = None


async def follow(fwd: Forward, thread: MLXThread, model: Model, ring: Ring) -> None:
    """Serve rank 0's steps until it stops the ring; DistributedError naming the rank that was lost."""
    hidden = model.args.hidden_size
    seq: _Sequence | None = None
    while True:
        try:
            header, h = await run_on(thread, ring.recv, ring.prev, lambda hd: (1, hd.rows, hidden), True)
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
        if header.op is not Op.STEP:
            raise DistributedError(f"rank {ring.rank}: rank {ring.prev} sent {header.op.name} where a step was due")
        if header.fresh or seq is None:
            seq = await run_on(thread, _Sequence, model)
        assert h is not None
        tail = _last_tail(ring, model, seq, header) if ring.rank == ring.size - 1 else _pass_on(ring, seq, header)
        await fwd.run(_given(h), seq.cache, tail)


def _given(h: mx.array) -> Any:
    return lambda: h


def _pass_on(ring: Ring, seq: _Sequence, header: Header) -> Any:
    def tail(h: mx.array) -> None:
        ring.send(Header(Op.STEP, rows=header.rows, kind=header.kind, fresh=header.fresh, dtype=dtype_code(h),
                         seed=header.seed, temperature=header.temperature, top_p=header.top_p), h, ring.next)
        if header.kind == TailKind.SETTLE:
            mx.eval([c.state for c in seq.cache if c is not None])

    return tail


def _last_tail(ring: Ring, model: Model, seq: _Sequence, header: Header) -> Any:
    def tail(h: mx.array) -> None:
        value: mx.array | None
        match header.kind:
            case TailKind.SETTLE:
                Settle(seq.cache)(h)
                value = None
            case TailKind.LOGITS | TailKind.LAST_LOGITS:
                value = mx.array(Logits(model, last_only=header.kind == TailKind.LAST_LOGITS)(h))
            case TailKind.SAMPLE:
                if seq.sampling is None:  # seeded as its sequence's first token is drawn, as in one process
                    seq.sampling = Sampling(model, seq.cache, header.temperature, header.top_p,
                                            None if header.seed < 0 else header.seed)
                value = seq.sampling.next_token(h).reshape(1)
            case _:
                raise DistributedError(f"rank {ring.rank}: unknown step end {header.kind}")
        ring.send(Header(Op.RESULT, rows=header.rows, kind=header.kind,
                         dtype=-1 if value is None else dtype_code(value)), value, ring.next)

    return tail
