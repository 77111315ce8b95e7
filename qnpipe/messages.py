"""Every message on the pipeline's channels: frozen, tagged msgspec Structs.

Each carries `t` (trio.current_time() when sent: virtual in replay) and `seq` (the
sender's counter), which give a total, deterministic order. Messages hold ids only,
never arrays: the slot buffers stay with the pool's arrays and the forward.
Commands are imperative (`Acquire`), events past tense (`ReadDone`). Tags never change;
add a new one instead.

The read unit lives here too, at the bottom of the house: `ReadClass` and `Job` (one read
of `ReadExperts`, what the read queue orders and a device reads), so qnpipe.policy and
qnpipe.io both take it from below instead of one from the other.
"""

from __future__ import annotations

import enum
import math

import attrs
import msgspec


class ReadClass(enum.IntEnum):
    """Priority class of a read; lower goes first."""

    DEMAND = 0
    PREFETCH = 1


@attrs.frozen(slots=True)
class Job:
    """Read expert `expert` of `layer` into `slot` (one read of a `ReadExperts`).

    Prefetches carry the time the forward is expected to need them (`deadline`, trio
    clock seconds) and the predictor's `score`; demand reads have neither.
    """

    layer: int
    expert: int
    slot: int
    cls: ReadClass = ReadClass.DEMAND
    deadline: float = math.inf
    score: float = 0.0
    key: tuple[int, int] = attrs.field(init=False, eq=False, repr=False)  # (layer, expert): what merges

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "key", (self.layer, self.expert))  # frozen: set once, read per queue operation


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of every message: `t` in seconds of the trio clock, `seq` per sender."""

    t: float
    seq: int


class Acquire(Msg, frozen=True, kw_only=True, tag="pool.acquire"):
    """The forward needs `experts` (distinct ids) of `layer` resident for pass `part` of `step`.

    The pool answers with one `Granted` once every one of them is in memory, and holds
    them until the matching `Release`. With `early`, when some must be read, it first sends
    `Present` for those in memory (if any), then one for those of each burst of reads that
    lands before the last, so their work can start during the reads.
    """

    step: int
    layer: int
    part: int
    experts: tuple[int, ...]
    early: bool = False


class Present(Msg, frozen=True, kw_only=True, tag="pool.present"):
    """Before the `Granted` of an early `Acquire`: `experts[i]` (in memory now, and not in an
    earlier `Present` of the grant) is in slot `slots[i]`, held from now on as the grant's;
    the others are being read or were given before."""

    step: int
    layer: int
    part: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]


class Granted(Msg, frozen=True, kw_only=True, tag="pool.granted"):
    """`experts[i]` is in slot `slots[i]` (written `generations[i]` times) until released.

    `misses` of them were read for this grant; `waited_s` is the time from the
    `Acquire` to this grant (the stall when misses > 0).
    """

    step: int
    layer: int
    part: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    hits: int
    misses: int
    waited_s: float


class Release(Msg, frozen=True, kw_only=True, tag="pool.release"):
    """The computation that read the grant of (`step`, `layer`, `part`) has finished.

    With route verification on, `token_experts` / `token_slots` are the (expert, slot)
    pairs every token of the step actually used, which the pool checks against its table.
    """

    step: int
    layer: int
    part: int
    token_experts: tuple[int, ...] = ()
    token_slots: tuple[int, ...] = ()


class ForwardDone(Msg, frozen=True, kw_only=True, tag="pool.forward_done"):
    """One forward step of the model finished (eviction bookkeeping such as LFU decay)."""

    step: int


class ReadExpert(Msg, frozen=True, kw_only=True, tag="read.request"):
    """Read expert `expert` of `layer` into `slot` of that layer's arrays (an event-log record:
    one per read the pool asks for; the channel carries them as `ReadExperts`).

    A prefetch (`cls` PREFETCH) carries when the forward should need it (`deadline`, trio
    clock seconds) and the predictor's `score`.
    """

    layer: int
    expert: int
    slot: int
    cls: ReadClass = ReadClass.DEMAND
    deadline: float = math.inf
    score: float = 0.0


class ReadExperts(Msg, frozen=True, kw_only=True, tag="read.requests"):
    """Read `experts` of `layer` into `slots` (pairwise), all of class `cls`: what one acquire,
    hint or expired prefetch asks of the read scheduler, in one message (the log has a
    `ReadExpert` per read). Prefetches carry `deadline` and a `scores` entry per expert."""

    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    cls: ReadClass = ReadClass.DEMAND
    deadline: float = math.inf
    scores: tuple[float, ...] = ()


class Promote(Msg, frozen=True, kw_only=True, tag="read.promote"):
    """A step now waits on the prefetch of (`layer`, `expert`): read it as a demand read if still queued."""

    layer: int
    expert: int


class ReadExpired(Msg, frozen=True, kw_only=True, tag="read.expired"):
    """A prefetch of (`layer`, `expert`) into `slot` was not started: its deadline had passed."""

    layer: int
    expert: int
    slot: int


class Candidates(Msg, frozen=True, kw_only=True, tag="predict.candidates"):
    """The forward's per-token top-`width` experts of `target`'s gate, computed at MoE layer `layer`.

    `token_experts` / `token_scores` are token-major (`width` per token); `deadline` is when
    the forward expects to reach `target`.
    """

    step: int
    layer: int
    target: int
    width: int
    token_experts: tuple[int, ...]
    token_scores: tuple[float, ...]
    deadline: float


class PrefetchHint(Msg, frozen=True, kw_only=True, tag="predict.hint"):
    """Advisory: read these experts of `layer` before `deadline`; best first, with their scores."""

    step: int
    source: int
    layer: int
    experts: tuple[int, ...]
    scores: tuple[float, ...]
    deadline: float


class ReadDone(Msg, frozen=True, kw_only=True, tag="read.done"):
    """The record of (`layer`, `expert`) is in `slot`; issued at `issued_t`, on the device from `started_t`
    (an event-log record: one per read; the channel carries a device batch's as `ReadsDone`)."""

    layer: int
    expert: int
    slot: int
    nbytes: int
    issued_t: float
    started_t: float


class ReadsDone(Msg, frozen=True, kw_only=True, tag="read.dones"):
    """One device batch finished: the record of (`layers[i]`, `experts[i]`) is in `slots[i]`,
    `nbytes[i]` bytes, asked for at `issued_t[i]`; the batch went on the device at `started_t`."""

    layers: tuple[int, ...]
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    nbytes: tuple[int, ...]
    issued_t: tuple[float, ...]
    started_t: float


PoolInbox = Acquire | Release | ForwardDone | ReadsDone | ReadExpired | PrefetchHint
ForwardInbox = Granted | Present
ReadInbox = ReadExperts | Promote
PredictorInbox = Candidates
