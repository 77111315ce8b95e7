"""Every message on the pipeline's channels: frozen, tagged msgspec Structs.

Each carries `t` (trio.current_time() when sent: virtual in replay) and `seq` (the
sender's counter), which give a total, deterministic order. Messages hold ids only,
never arrays: the slot buffers stay with the pool's arrays and the forward.
Commands are imperative (`Acquire`), events past tense (`ReadDone`). Tags never change;
add a new one instead.
"""

from __future__ import annotations

import msgspec

from qnpipe.policy.read_queue import ReadClass


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of every message: `t` in seconds of the trio clock, `seq` per sender."""

    t: float
    seq: int


class Acquire(Msg, frozen=True, kw_only=True, tag="pool.acquire"):
    """The forward needs `experts` (distinct ids) of `layer` resident for pass `part` of `step`.

    The pool answers with one `Granted` once every one of them is in memory, and holds
    them until the matching `Release`.
    """

    step: int
    layer: int
    part: int
    experts: tuple[int, ...]


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
    """Read expert `expert` of `layer` into `slot` of that layer's arrays."""

    layer: int
    expert: int
    slot: int
    cls: ReadClass = ReadClass.DEMAND


class ReadDone(Msg, frozen=True, kw_only=True, tag="read.done"):
    """The record of (`layer`, `expert`) is in `slot`; issued at `issued_t`, on the device from `started_t`."""

    layer: int
    expert: int
    slot: int
    nbytes: int
    issued_t: float
    started_t: float


PoolInbox = Acquire | Release | ForwardDone | ReadDone
ReadInbox = ReadExpert
