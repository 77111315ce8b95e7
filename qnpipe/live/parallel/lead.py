"""Rank 0's side of a step: its layers' output goes around the ring, the step's value comes back.

`Lead.tail` replaces a step's tail (qnpipe.model.tails) in `MlxBackend.begin`: the decoding loops
(qnpipe.live.decoding) run unchanged, each step one pass around the ring, its tail run by the
last rank (`follow`). MLX thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from qnpipe.errors import DistributedError
from qnpipe.live.parallel.ring import SNAP_WORDS, Header, Op, Ring, SnapAction, dtype_code
from qnpipe.model.tails import TailKind


def result_shape(kind: int, rows: int, vocab: int) -> tuple[int, ...]:
    """The shape of the value the last rank sends back for a step of `rows` rows."""
    match kind:
        case TailKind.LOGITS:
            return (rows, vocab)
        case TailKind.LAST_LOGITS:
            return (vocab,)
        case TailKind.SAMPLE:
            return (1,)
        case TailKind.MTP_FIRST | TailKind.MTP_VERIFY:
            return (rows,)  # token ids: the committed ones, then the next round's drafts
    raise AssertionError(f"a {TailKind(kind).name} step has no value")


_SETTLES = (TailKind.SETTLE, TailKind.MTP_SETTLE)  # steps with no value: their answers are read later


class Lead:
    def __init__(self, ring: Ring, vocab_size: int, forward: Any = None) -> None:
        self.ring = ring
        self.vocab = vocab_size
        # The forward actor (qnpipe.actors.forward.Forward) whose stall watchdog must not count the
        # other ranks' work as this step's stall: the ring's own deadline covers that wait.
        self.forward = forward
        # Settle steps (prefill chunks but the last) do not wait for their answer: the next chunk
        # runs here while later ranks run this one. Their answers are read, in order, before the
        # next answer that carries a value.
        self._unread = 0
        # The sequence the last step was of: a step on another cache starts a new one on every rank.
        self._cache: list[Any] | None = None

    def tail(self, tail: Callable[[mx.array], Any], cache: list[Any]) -> Callable[[mx.array], Any]:
        kind = getattr(tail, "kind", None)
        if kind is None:
            raise DistributedError(f"this step's end ({tail!r}) does not run distributed yet")
        fresh = cache is not self._cache
        self._cache = cache
        sampling = getattr(tail, "sampling", None)
        seed = -1 if sampling is None or sampling.seed is None else int(sampling.seed)
        temperature = 0.0 if sampling is None else float(sampling.temperature)
        top_p = 1.0 if sampling is None else float(sampling.top_p)
        # MTP speculation (qnpipe.live.parallel.speculate.RingMtp): token ids for the last rank, the
        # rollback of the last verify step, the drafts per round.
        ids: list[int] = list(getattr(tail, "ids", ()))
        keep, depth = int(getattr(tail, "keep", 0)), int(getattr(tail, "depth", 0))
        ring = self.ring

        def around(h: mx.array) -> Any:
            header = Header(Op.STEP, rows=h.shape[1], kind=int(kind), fresh=fresh, dtype=dtype_code(h), seed=seed,
                            temperature=temperature, top_p=top_p, ids=len(ids), keep=keep, depth=depth)
            if self.forward is not None:
                self.forward.busy = False  # an attribute store: safe from this thread; run() resets it
            ring.send(header, h, ring.next)
            if ids:
                ring.send_ids(mx.array(ids, dtype=mx.uint32), ring.next)
            if kind in _SETTLES:
                mx.eval([c.state for c in cache if c is not None])
                self._unread += 1
                return None
            self._read_settled()
            back, value = self._answer()
            assert value is not None and back.kind == kind, back
            if kind == TailKind.SAMPLE:
                return value.reshape(())
            return np.array(value)

        return around

    def snap(self, action: SnapAction, n_tokens: int, words: np.ndarray, depth: int = 0) -> np.ndarray | None:
        """Send a prefix snapshot's message (qnpipe.live.parallel.snap) after the steps sent so far; for a
        restore, its answer (the words as the last rank passed them on). `depth` > 0: MTP sequences."""
        ring = self.ring
        payload = mx.array(words.astype(np.uint32))
        ring.send(Header(Op.SNAP, rows=n_tokens, kind=int(action), dtype=dtype_code(payload), depth=depth), payload,
                  ring.next)
        if action is not SnapAction.RESTORE:
            return None
        self._read_settled()
        _, value = self._answer(Op.SNAP)
        assert value is not None
        return np.array(value)

    def adopt(self, cache: list[Any]) -> None:
        """The next step on `cache` continues the sequence every rank just restored (not a new one)."""
        self._cache = cache

    def _answer(self, op: Op = Op.RESULT) -> tuple[Header, mx.array | None]:
        ring = self.ring
        back, value = ring.recv(ring.prev, lambda hd: (SNAP_WORDS,) if hd.op is Op.SNAP
                                else result_shape(hd.kind, hd.rows, self.vocab))
        if back.op is Op.FAIL:
            assert ring.broken is not None
            raise ring.broken
        if back.op is not op:
            raise DistributedError(f"rank 0: rank {ring.prev} answered a {'step' if op is Op.RESULT else op.name} "
                                   f"with {back.op.name}")
        return back, value

    def _read_settled(self) -> None:
        while self._unread:
            back, _ = self._answer()
            assert back.kind in _SETTLES, back
            self._unread -= 1

    def close(self) -> None:
        """Stop the other ranks (they leave their loops) and wait until the last one has."""
        if self.ring.broken is not None:
            return
        self._read_settled()
        self.ring.send(Header(Op.STOP), None, self.ring.next)
        back, _ = self.ring.recv(self.ring.prev, lambda hd: (0,))
        if back.op is not Op.STOP:
            raise DistributedError(f"rank 0: rank {self.ring.prev} answered the stop with {back.op.name}")
