"""The ranks' messages over `mx.distributed` (MLX thread only).

Every message is a header (`HEADER` int64: op, rows or rank, tail kind, fresh, payload dtype,
seed, temperature and top-p as float64 bits, and MTP speculation's token-id count, rollback and
draft depth) and, for a step or a result, one array; a step may carry token ids after it
(`send_ids`: the prompt tokens the last rank's MTP head reads). A step
goes from rank r to r + 1 with the hidden state `[1, L, H]`; the last rank sends the step's
value (a token, logits, or nothing) to rank 0: in a ring both are neighbours. A `SNAP` message
(prefix snapshots: `SnapAction`) goes the same way with `SNAP_WORDS` uint32 (the state's key).

Each message is one frame of `frame_bytes` (the header, then the array's bytes when they fit:
a decode step's hidden state or a token), so a decode step costs one MLX send and recv per hop;
a larger array (a prefill chunk, logits) follows its header as a message of its own. Every
MLX ring message has a fixed cost (≈ 1 ms on a loaded 2-core VM: two messages per hop doubled
the hand-off).

Once a send or a recv fails MLX's ring cannot be used again (later calls block), so the first
failure is kept and raised by every later call. A rank that loses its previous rank tells the
next one (`FAIL` naming the lost rank), so rank 0 names the rank that died, not its neighbour.
"""

from __future__ import annotations

import enum
import hashlib
import math
import secrets
import threading
import time
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from qnpipe.config.launch import Launch
from qnpipe.errors import DistributedError
from qnpipe.live.parallel.deadman import Deadman, outside

HEADER = 11
HEADER_BYTES = HEADER * 8


class Op(enum.IntEnum):
    STEP = 1
    STOP = 2
    FAIL = 3
    RESULT = 4
    SNAP = 5  # a prefix snapshot's capture, restore or drop (qnpipe.live.parallel.snap)
    PING = 6  # rank 0 is alive and sends nothing else (qnpipe.live.parallel.keepalive): passed on, no answer


class SnapAction(enum.IntEnum):
    """What a SNAP message asks of every rank (its header's `kind`; `rows` is the state's tokens, `depth`
    on a restore the MTP drafts per round: 0 for a sequence without MTP speculation)."""

    CAPTURE = 1  # keep the current sequence's state: one way, after the step that reached it
    RESTORE = 2  # start a new sequence in a kept state: round the ring, the last rank answers rank 0
    DROP = 3  # forget a kept state: one way


SNAP_WORDS = 10  # a SNAP message's uint32 payload (qnpipe.live.parallel.snap.encode)


DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.bfloat16, mx.float16, mx.uint32, mx.int32)


@attrs.frozen
class Header:
    op: Op
    rows: int = 0  # the step's rows; for FAIL, the rank that was lost
    kind: int = 0  # qnpipe.model.tails.TailKind
    fresh: bool = False  # the first step of a new sequence: a new cache
    dtype: int = -1  # index in DTYPES of the array that follows, -1 = none
    seed: int = -1
    temperature: float = 0.0
    top_p: float = 1.0
    ids: int = 0  # MTP: uint32 token ids that follow the payload as a message of their own (`send_ids`)
    keep: int = 0  # MTP: before this step, roll the last verify step back to its first `keep` rows (0: none)
    depth: int = 0  # MTP: drafts per round (K)

    def encode(self) -> mx.array:
        floats = np.array([self.temperature, self.top_p], dtype=np.float64).view(np.int64)
        return mx.array(np.array([int(self.op), self.rows, self.kind, int(self.fresh), self.dtype, self.seed,
                                  *floats.tolist(), self.ids, self.keep, self.depth], dtype=np.int64))

    @classmethod
    def decode(cls, a: np.ndarray) -> Header:
        t, p = a[6:8].astype(np.int64).view(np.float64).tolist()
        return cls(Op(int(a[0])), int(a[1]), int(a[2]), bool(a[3]), int(a[4]), int(a[5]), t, p,
                   int(a[8]), int(a[9]), int(a[10]))


def dtype_code(a: mx.array) -> int:
    return DTYPES.index(a.dtype)


_lock = threading.Lock()
_ring: Ring | None = None


class Ring:
    """This process's rank in the group; one per process, shared by its engines."""

    def __init__(self, group: Any, deadman: Deadman, step_timeout_s: float) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        self.deadman = deadman
        self.step_timeout_s = step_timeout_s
        self.broken: DistributedError | None = None
        self.sent_at = time.monotonic()  # the last send to the next rank: rank 0's keep-alive pings after a pause
        # Every rank must use the same: set from the model (`fit`) before the first step.
        self.frame_bytes = HEADER_BYTES + 64

    def fit(self, hidden_size: int, rows: int = 1) -> None:
        """Frames that hold `rows` rows of a float32 hidden state of `hidden_size` after the header
        (MTP speculation: a verify step's K + 1)."""
        self.frame_bytes = HEADER_BYTES + 4 * hidden_size * rows

    @classmethod
    def connect(cls, launch: Launch, connect_timeout_s: float, step_timeout_s: float) -> Ring:
        """Join the group `mlx.launch` set up, once per process. MLX reads MLX_RANK / MLX_HOSTFILE
        itself: `launch` is what qnpipe.config.launch.read_launch checked of them first."""
        global _ring
        with _lock:
            if _ring is None:
                deadman = Deadman()
                with outside(connect_timeout_s, _never_connected(launch, connect_timeout_s)):
                    try:
                        group = mx.distributed.init(strict=True, backend="ring")
                    except RuntimeError as e:
                        raise DistributedError(f"cannot join the mx.distributed ring ({e}); start every rank "
                                               f"with mlx.launch --backend ring (docs/distributed.md)") from None
                _ring = cls(group, deadman, step_timeout_s)
            _ring.step_timeout_s = step_timeout_s
            return _ring

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _fail(self, peer: int, what: str, e: Exception) -> DistributedError:
        self.broken = DistributedError(f"rank {self.rank}: {what} rank {peer} failed: rank {peer} was lost ({e})")
        return self.broken

    def send(self, header: Header, payload: mx.array | None, to: int) -> None:
        """`header` then `payload` to rank `to` (each evaluated: the socket order is theirs)."""
        self._check()
        head = mx.view(header.encode(), mx.uint8)
        inline = payload is not None and HEADER_BYTES + payload.nbytes <= self.frame_bytes
        parts = [head, mx.view(payload, mx.uint8).reshape(-1)] if inline and payload is not None else [head]
        pad = self.frame_bytes - sum(p.size for p in parts)
        frame = mx.concatenate([*parts, mx.zeros((pad,), dtype=mx.uint8)]) if pad else mx.concatenate(parts)
        try:
            with self.deadman.waiting(self.step_timeout_s, f"rank {self.rank}: sending to rank {to} took over "
                                      f"{self.step_timeout_s} s (distributed.step_timeout_s); stopping"):
                mx.eval(mx.distributed.send(frame, to, group=self.group))
                if payload is not None and not inline:
                    mx.eval(mx.distributed.send(payload, to, group=self.group))
        except RuntimeError as e:
            raise self._fail(to, "sending to", e) from None
        self.sent_at = time.monotonic()

    def recv(self, frm: int, shape_of: Any) -> tuple[Header, mx.array | None]:
        """A header from rank `frm` and its array, whose shape is `shape_of(header)`, within the step
        timeout (between requests too: an idle rank 0 sends `PING`s). A `FAIL` header raises
        DistributedError naming the rank that was lost.
        """
        self._check()
        timeout = self.step_timeout_s
        try:
            with self.deadman.waiting(timeout, f"rank {self.rank}: no answer from rank {frm} in {timeout} s "
                                      f"(distributed.step_timeout_s): rank {frm} or one before it hangs; stopping"):
                frame = mx.distributed.recv((self.frame_bytes,), mx.uint8, frm, group=self.group)
                mx.eval(frame)
                header = Header.decode(np.array(frame[:HEADER_BYTES]).view(np.int64))
                if header.op is Op.FAIL:
                    self.broken = DistributedError(f"rank {self.rank}: rank {header.rows} was lost "
                                                   f"(reported by rank {frm})")
                    return header, None
                payload = None
                if header.dtype >= 0:
                    shape, dtype = tuple(shape_of(header)), DTYPES[header.dtype]
                    nbytes = math.prod(shape) * dtype.size
                    if HEADER_BYTES + nbytes <= self.frame_bytes:
                        payload = mx.view(frame[HEADER_BYTES:HEADER_BYTES + nbytes], dtype).reshape(shape)
                    else:
                        payload = mx.distributed.recv(shape, dtype, frm, group=self.group)
                    mx.eval(payload)
        except RuntimeError as e:
            raise self._fail(frm, "receiving from", e) from None
        return header, payload

    def send_ids(self, ids: mx.array, to: int) -> None:
        """Token ids (uint32) after a step whose header says how many (`Header.ids`)."""
        self._check()
        try:
            with self.deadman.waiting(self.step_timeout_s, f"rank {self.rank}: sending to rank {to} took over "
                                      f"{self.step_timeout_s} s (distributed.step_timeout_s); stopping"):
                mx.eval(mx.distributed.send(ids.astype(mx.uint32), to, group=self.group))
        except RuntimeError as e:
            raise self._fail(to, "sending to", e) from None

    def recv_ids(self, frm: int, n: int) -> mx.array:
        """The `n` token ids that follow a step from rank `frm`."""
        self._check()
        try:
            with self.deadman.waiting(self.step_timeout_s, f"rank {self.rank}: no answer from rank {frm} in "
                                      f"{self.step_timeout_s} s (distributed.step_timeout_s): rank {frm} or one "
                                      f"before it hangs; stopping"):
                ids = mx.distributed.recv((n,), mx.uint32, frm, group=self.group)
                mx.eval(ids)
        except RuntimeError as e:
            raise self._fail(frm, "receiving from", e) from None
        return ids

    def ping(self) -> None:
        """Rank 0's keep-alive to the next rank (qnpipe.live.parallel.keepalive)."""
        self.send(Header(Op.PING), None, self.next)

    def tell_lost(self, lost: int, to: int) -> None:
        """Best effort: tell rank `to` that rank `lost` is gone (its own link may be down too)."""
        err, self.broken = self.broken, None
        try:
            self.send(Header(Op.FAIL, rows=lost), None, to)
        except DistributedError:
            pass
        self.broken = err

    def check_same_run(self, parts: list[tuple[str, str]]) -> None:
        """DistributedError naming each rank whose qnpipe version or any of `parts` (what, value: the same
        list on every rank of one version) differs from rank 0's."""
        from qnpipe._version import __version__

        self._check()
        # First the version and the number of parts: the second gather's rows must be as long on every rank.
        first = self._all_gather(np.array([_word(__version__), len(parts)], dtype=np.int32), "start-up check")
        other = [r for r in range(1, self.size) if first[r].tolist() != first[0].tolist()]
        if other:
            raise DistributedError(f"rank {self.rank}: " + ", ".join(f"rank {r}" for r in other) +
                                   f" run{'s' if len(other) == 1 else ''} another qnpipe version than rank 0 "
                                   f"(this rank: {__version__}; every rank needs the same)")
        table = self._all_gather(np.array([_word(v) for _, v in parts], dtype=np.int32), "start-up check")
        bad = []
        for r in range(1, self.size):
            differ = [what for (what, _), a, b in zip(parts, table[0], table[r], strict=True) if a != b]
            if differ:
                bad.append(f"rank {r} differs from rank 0 in its " + ", ".join(differ))
        if bad:
            raise DistributedError(f"rank {self.rank}: " + "; ".join(bad) +
                                   " (every rank needs the same model files, qnpipe version and settings)")

    def gather_budgets(self, budget: int) -> list[int]:
        """Every rank's `budget` (bytes, 0 <= budget < 2**62: its `--memory`, 0 for none), by rank."""
        self._check()
        mine = np.array([budget >> 31, budget & 0x7FFFFFFF], dtype=np.int32)  # int32: check_same_run's dtype
        return [(int(hi) << 31) | int(lo) for hi, lo in self._all_gather(mine, "exchange of --memory budgets").tolist()]

    def run_id(self) -> str:
        """Rank 0's random id, the same on every rank: the run's in each rank's log header (`Header.run`), by
        which `trace merge` tells the logs of one run from another's."""
        self._check()
        mine = np.frombuffer(secrets.token_bytes(8), dtype=np.int32)
        return "".join(f"{int(w) & 0xFFFFFFFF:08x}" for w in self._all_gather(mine, "exchange of the run id")[0])

    def _all_gather(self, mine: np.ndarray, what: str) -> np.ndarray:
        """Every rank's int32 row `mine`, by rank; DistributedError naming `what` when it fails or hangs."""
        try:
            with self.deadman.waiting(self.step_timeout_s, f"rank {self.rank}: the ranks' {what} took over "
                                      f"{self.step_timeout_s} s; stopping"):
                every = mx.distributed.all_gather(mx.array(mine), group=self.group)
                mx.eval(every)
        except RuntimeError as e:
            self.broken = DistributedError(f"rank {self.rank}: the ranks' {what} failed ({e})")
            raise self.broken from None
        return np.array(every).reshape(self.size, len(mine))


def _word(value: str) -> int:
    """A 31-bit hash of `value`: one int32 of the start-up check's rows."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=4).digest(), "little") >> 1


def _never_connected(launch: Launch, timeout_s: float) -> str:
    return (f"rank {launch.rank}: the mx.distributed ring did not connect within {timeout_s} s "
            f"(distributed.connect_timeout_s): {launch.neighbours()} (MLX_HOSTFILE {launch.hostfile}) never "
            f"answered; is qnpipe started on every host of the hostfile?")
