"""The event log: its records, how it is written, and `read` (format: docs/trace-format.md).

A log is the 8-byte magic ``b"QNPTRACE"`` then frames, each a 4-byte little-endian
unsigned length and that many bytes of one msgpack object: frame 0 is the `Header`,
every later frame one record (a tagged msgspec Struct, ``kind`` = its tag), and the last
frame the `Footer`. Length prefixes make a torn or truncated file detectable at the exact
record; a file without its footer is incomplete.

Records are the pipeline's own messages (qnpipe.messages: `Acquire`, `Granted`,
`ReadExpert`, `ReadDone`, `Release`, `ForwardDone`) plus the events defined here, which
exist only in the log. Times `t` are the trio clock (seconds, virtual in replay); the
header holds the single wall-clock reading, for humans.

Bump `SCHEMA_VERSION` whenever a traced Struct changes; `read` refuses a newer version.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from qnpipe.errors import TraceSchemaError
from qnpipe.messages import (
    Acquire,
    Candidates,
    ForwardDone,
    Granted,
    Msg,
    PrefetchHint,
    Present,
    Promote,
    ReadDone,
    ReadExpert,
    ReadExpired,
    Release,
)

SCHEMA_VERSION = 1
MAGIC = b"QNPTRACE"
_LEN = struct.Struct("<I")


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """The model's shape as far as routing goes."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int

    @classmethod
    def of(cls, args: Any) -> ModelShape:
        """From a qnpipe.model.args.ModelArgs."""
        return cls(num_layers=args.num_hidden_layers, moe_layers=tuple(args.moe_layers),
                   num_experts=args.num_experts, top_k=args.num_experts_per_tok, hidden_size=args.hidden_size)


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """Frame 0. `clock_start_t` is trio.current_time() when the log opened; `wall_start_unix_s` is for humans."""

    schema_version: int
    fingerprint: str  # Config.fingerprint() of the run
    model: ModelShape | None  # None when the pipeline was started without a model (actor tests)
    clock_start_t: float
    wall_start_unix_s: float
    contents: str  # "events" (the event log) or "routes" (the routing log: `Route` records only)
    layers: tuple[int, ...] = ()  # routing log: the layers recorded (empty = all)
    capacities: dict[int, int] = {}  # slots per MoE layer


class Route(Msg, frozen=True, kw_only=True, tag="trace.route"):
    """The router of `layer` in `step`: token i chose `experts[i*top_k:(i+1)*top_k]` with `weights` (same layout)."""

    step: int
    layer: int
    top_k: int
    experts: tuple[int, ...]
    weights: tuple[float, ...] = ()  # the gate weights the experts' outputs are mixed with; () = not known


class ReadStarted(Msg, frozen=True, kw_only=True, tag="read.started"):
    """The read of (`layer`, `expert`) into `slot` went to the device (one batch shares one `t`)."""

    layer: int
    expert: int
    slot: int


class Evicted(Msg, frozen=True, kw_only=True, tag="pool.evicted"):
    """`expert` of `layer` left `slot` to make room for `for_expert`."""

    layer: int
    expert: int
    slot: int
    for_expert: int


class Stalled(Msg, frozen=True, kw_only=True, tag="pool.stall"):
    """A grant that had misses: the forward waited `waited_s` for (`step`, `layer`, `part`). Same t/seq as its `Granted`."""

    step: int
    layer: int
    part: int
    misses: int
    waited_s: float


class UnionSize(Msg, frozen=True, kw_only=True, tag="diag.union"):
    """diag.union_prof: a layer-step of `tokens` tokens routed to `union` distinct experts."""

    step: int
    layer: int
    tokens: int
    union: int


class SpecRound(Msg, frozen=True, kw_only=True, tag="spec.round"):
    """One MTP speculation round: `drafts` verified by forward step `step`, `accepted` of them kept,
    then the model's own token `bonus`."""

    step: int
    drafts: tuple[int, ...]
    accepted: int
    bonus: int


class RecallSample(Msg, frozen=True, kw_only=True, tag="diag.recall"):
    """diag.predict_recall_prof: of the `used` experts of a layer-step, `predicted` were among the candidates."""

    step: int
    layer: int
    used: int
    predicted: int


class RequestStart(Msg, frozen=True, kw_only=True, tag="trace.request"):
    """Request `request` (0-based) begins: the `trace.route` records from step `first_step` on are its own.

    Written by `qnpipe trace import` when a source holds several requests; they follow one another
    in the log (steps keep counting), as a single-stream engine would serve them. `name` is the
    source's id for it (a problem id, a batch row).
    """

    request: int
    first_step: int
    name: str = ""


class Footer(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="trace.footer"):
    """The last frame: how many records were written and how many events were dropped (channel full)."""

    records: int
    dropped: int
    clock_end_t: float


Record = (Acquire | Granted | Present | Release | ForwardDone | ReadExpert | ReadDone | Route | ReadStarted | Evicted
          | Stalled | Candidates | PrefetchHint | Promote | ReadExpired | UnionSize | RecallSample | RequestStart
          | SpecRound)

_ENCODER = msgspec.msgpack.Encoder()
_FRAME_DECODER = msgspec.msgpack.Decoder(Record | Footer)
_HEADER_DECODER = msgspec.msgpack.Decoder(Header)


def route_record(stamp: Any, step: int, layer: int, ids: np.ndarray, weights: np.ndarray | None) -> Route:
    """The `Route` of one layer-step from the router's ids and weights ([N, k] each)."""
    k = int(ids.shape[-1])
    w = () if weights is None else tuple(weights.reshape(-1).astype(np.float64).tolist())
    return Route(**stamp, step=step, layer=layer, top_k=k, experts=tuple(ids.reshape(-1).tolist()), weights=w)


class TraceWriter:
    """Writes one log to ``<path>.partial`` and renames it to `path` on `close` (no torn final file).

    `flush` pushes what is buffered to the partial file (the recorder calls it every second), so
    after a crash the partial file holds every record up to the last flush.
    """

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.records = 0
        self._f: IO[bytes] | None = open(self.partial, "wb", buffering=1 << 20)  # noqa: SIM115
        self._f.write(MAGIC)
        self._frame(header)

    def _frame(self, obj: Any) -> None:
        assert self._f is not None
        buf = _ENCODER.encode(obj)
        self._f.write(_LEN.pack(len(buf)))
        self._f.write(buf)

    def write(self, rec: Record) -> None:
        self._frame(rec)
        self.records += 1

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self, dropped: int, clock_end_t: float) -> None:
        """Write the footer, close and rename the file into place."""
        if self._f is None:
            return
        self._frame(Footer(records=self.records, dropped=dropped, clock_end_t=clock_end_t))
        self._f.close()
        self._f = None
        os.replace(self.partial, self.path)

    def abandon(self) -> None:
        """Close without a footer, leaving only the partial file (the run failed to finish the log)."""
        if self._f is not None:
            self._f.close()
            self._f = None


def _frames(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceSchemaError(f"{path}: cannot read the trace ({e.strerror or e})") from None
    if data[:len(MAGIC)] != MAGIC:
        raise TraceSchemaError(f"{path}: not a qnpipe trace (no {MAGIC!r} magic)")
    pos, n = len(MAGIC), 0
    while pos < len(data):
        if pos + _LEN.size > len(data):
            raise TraceSchemaError(f"{path}: truncated at record {n} (byte {pos}: partial length prefix)")
        (size,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + size > len(data):
            raise TraceSchemaError(f"{path}: truncated at record {n} (byte {pos}: {size} bytes announced, "
                                   f"{len(data) - pos} left)")
        yield n, data[pos:pos + size]
        pos += size
        n += 1


def iter_records(path: str | Path) -> Iterator[Header | Record | Footer]:
    """The header, then every record, then the footer, typed; TraceSchemaError names the file and record.

    Record 0 is the header. Raises TraceSchemaError for a newer schema, a corrupt or
    truncated frame, or a log without its footer.
    """
    p = Path(path)
    footer = False
    last = -1
    for n, buf in _frames(p):
        last = n
        if footer:
            raise TraceSchemaError(f"{p}: record {n} follows the footer")
        if n == 0:
            try:
                raw = msgspec.msgpack.decode(buf)
                version = raw.get("schema_version") if isinstance(raw, dict) else None
            except msgspec.DecodeError as e:
                raise TraceSchemaError(f"{p}: record 0 (header) is corrupt: {e}") from None
            if not isinstance(version, int):
                raise TraceSchemaError(f"{p}: record 0 (header) has no schema_version")
            if version > SCHEMA_VERSION:
                raise TraceSchemaError(f"{p}: schema version {version} is newer than this qnpipe reads "
                                       f"({SCHEMA_VERSION}); upgrade qnpipe")
            try:
                yield _HEADER_DECODER.decode(buf)
            except msgspec.DecodeError as e:
                raise TraceSchemaError(f"{p}: record 0 (header) is corrupt: {e}") from None
            continue
        try:
            rec = _FRAME_DECODER.decode(buf)
        except msgspec.DecodeError as e:
            raise TraceSchemaError(f"{p}: record {n} is corrupt: {e}") from None
        footer = isinstance(rec, Footer)
        yield rec
    if not footer:
        raise TraceSchemaError(f"{p}: truncated after record {last}: no footer "
                               f"(the run did not close the log)")


def canonical(records: list[Record]) -> list[Record]:
    """`records` in the canonical order `(t, kind, layer, expert, seq)` (style §7.4), for golden comparisons.

    The file holds them in the order the recorder received them: a message is recorded when
    the pool receives it, so its `t` (when it was sent) may precede records written before it.
    """
    def key(r: Record) -> tuple[float, str, int, int, int]:
        return (r.t, str(type(r).__struct_config__.tag), getattr(r, "layer", -1), getattr(r, "expert", -1), r.seq)

    return sorted(records, key=key)


def read_all(path: str | Path) -> tuple[Header, list[Record], Footer]:
    """The whole log: header, records, footer."""
    it = iter_records(path)
    header = next(it, None)
    if not isinstance(header, Header):
        raise TraceSchemaError(f"{path}: truncated at record 0: no header")
    records: list[Record] = []
    footer: Footer | None = None
    for rec in it:
        if isinstance(rec, Footer):
            footer = rec
        else:
            assert not isinstance(rec, Header)
            records.append(rec)
    assert footer is not None  # iter_records raises otherwise
    return header, records, footer


def read(path: str | Path) -> tuple[Header, list[Record]]:
    """`(header, records)` of a log, typed (the footer is checked, not returned: see `read_all`)."""
    header, records, _ = read_all(path)
    return header, records


__all__ = ["MAGIC", "SCHEMA_VERSION", "Candidates", "Evicted", "RecallSample", "SpecRound", "UnionSize", "Footer", "Header",
           "PrefetchHint", "ModelShape", "ReadStarted", "Record", "RequestStart", "Route", "Stalled", "TraceWriter",
           "canonical", "iter_records", "read", "read_all",
           "route_record"]
