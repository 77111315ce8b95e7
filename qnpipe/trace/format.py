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

import contextlib
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

import msgspec
import numpy as np

from qnpipe.errors import OutputError, TraceSchemaError
from qnpipe.io.files import MiB, check_regular
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
from qnpipe.trace.paths import check_log_paths, check_output_path, partial_path

SCHEMA_VERSION = 1
MAGIC = b"QNPTRACE"
_LEN = struct.Struct("<I")

# Bounds on what a log may announce, checked before a reader sizes anything by them (trace stats
# builds an experts x experts table, replay a pool of every MoE layer's experts). Each is far
# above any real model (the 80B: 48 layers, 512 experts, top-10, hidden size 2048).
MAX_LAYERS = 1 << 16
MAX_EXPERTS = 1 << 12
MAX_HIDDEN = 1 << 20
MAX_RANKS = 1 << 12
MAX_FRAME = 256 * MiB  # one record: the route of a 256k-token prefill at top-10 with weights is ~30 MB
TRACE_CAP = 64 << 30  # a whole log (a long 80B run logging every event writes a few GB)


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


class RunPart(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank of a distributed run writes in its log's header: which run, which rank, which layers.

    `id` is rank 0's, shared with every rank at start-up (qnpipe.live.parallel.join), so the logs of
    one run carry one id; `trace merge` takes only a whole run's logs, each rank once.
    """

    id: str
    rank: int
    ranks: int
    lo: int  # the rank's decoder layers lo..hi-1 (the last rank also holds the MTP head's layer, num_layers)
    hi: int


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
    # A rank of a distributed run; UNSET (not written: a one-process log's bytes are those of before) otherwise.
    run: RunPart | msgspec.UnsetType = msgspec.UNSET
    # pool.evict_policy of the run, so a replay can use it (UNSET: not recorded, e.g. an imported log).
    evict_policy: str | msgspec.UnsetType = msgspec.UNSET


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
    after a crash the partial file holds every record up to the last flush. Any failure to
    write (a full disk, EFBIG, an I/O error, the target turned into a directory) is an
    OutputError naming `path`, after the partial file has been removed: nothing is left.
    """

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self.what = "routing log" if header.contents == "routes" else "event log"
        self.records = 0
        self._f: IO[bytes] | None = None
        check_output_path(self.path, self.what, probe=False)  # first: `.` has no name to put `.partial` on
        self.partial = partial_path(self.path)
        try:
            # O_NONBLOCK: a FIFO left at the partial name must not block the open; O_NOFOLLOW: nor a link redirect it.
            fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK
                         | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write the {self.what} ({e.strerror or e})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"{self.path}: cannot write the {self.what}: {self.partial.name} is not a regular file")
        self._f = os.fdopen(fd, "wb", buffering=1 << 20)
        self._f.write(MAGIC)  # buffered: no I/O yet
        self._frame(header)

    def _fail(self, e: OSError) -> NoReturn:
        self.abandon()
        raise OutputError(f"{self.path}: cannot write the {self.what} ({e.strerror or e})") from None

    def _frame(self, obj: Any) -> None:
        assert self._f is not None, "the log is closed"
        buf = _ENCODER.encode(obj)
        try:
            self._f.write(_LEN.pack(len(buf)))
            self._f.write(buf)
        except OSError as e:
            self._fail(e)

    def write(self, rec: Record) -> None:
        self._frame(rec)
        self.records += 1

    def flush(self) -> None:
        if self._f is not None:
            try:
                self._f.flush()
            except OSError as e:
                self._fail(e)

    def close(self, dropped: int, clock_end_t: float) -> None:
        """Write the footer, close and rename the file into place (OutputError, nothing left, if that fails)."""
        if self._f is None:
            return
        self._frame(Footer(records=self.records, dropped=dropped, clock_end_t=clock_end_t))
        try:
            self._f.close()
            self._f = None
            os.replace(self.partial, self.path)
        except OSError as e:
            self._fail(e)

    def abandon(self) -> None:
        """Close without a footer and remove the partial file (the run failed to finish the log)."""
        if self._f is None:
            return
        f, self._f = self._f, None
        with contextlib.suppress(OSError):
            f.close()  # its flush fails again on a full disk: the file goes anyway
        with contextlib.suppress(OSError):
            os.unlink(self.partial)


def _frames(path: Path) -> Iterator[tuple[int, bytes]]:
    """The frames of a log, one at a time: every length is checked against the bytes left before it is read."""
    size = check_regular(path, cap=TRACE_CAP, error=TraceSchemaError)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceSchemaError(f"{path}: cannot read the trace ({e.strerror or e})") from None
    with os.fdopen(fd, "rb", buffering=1 << 20) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TraceSchemaError(f"{path}: not a regular file")
        try:
            yield from _read_frames(path, f, size)
        except OSError as e:
            raise TraceSchemaError(f"{path}: cannot read the trace ({e.strerror or e})") from None


def _read_frames(path: Path, f: IO[bytes], size: int) -> Iterator[tuple[int, bytes]]:
    if f.read(len(MAGIC)) != MAGIC:
        raise TraceSchemaError(f"{path}: not a qnpipe trace (no {MAGIC!r} magic)")
    pos, n = len(MAGIC), 0
    while True:
        head = f.read(_LEN.size)
        if not head:
            return
        if len(head) < _LEN.size:
            raise TraceSchemaError(f"{path}: truncated at record {n} (byte {pos}: partial length prefix)")
        (length,) = _LEN.unpack(head)
        pos += _LEN.size
        left = max(size - pos, 0)
        if length > left:
            raise TraceSchemaError(f"{path}: truncated at record {n} (byte {pos}: {length} bytes announced, "
                                   f"{left} left)")
        if length > MAX_FRAME:
            raise TraceSchemaError(f"{path}: record {n} is {length} bytes, over the {MAX_FRAME}-byte bound "
                                   f"of one record")
        buf = f.read(length)
        if len(buf) < length:  # the file shrank while being read
            raise TraceSchemaError(f"{path}: truncated at record {n} (byte {pos}: {length} bytes announced, "
                                   f"{len(buf)} read)")
        yield n, buf
        pos += length
        n += 1


def check_header(path: str | Path, header: Header) -> None:
    """Raise TraceSchemaError (naming the file and the field) for a header whose counts are out of bounds.

    Readers size tables by these counts (experts x experts, a pool per MoE layer), so they are
    checked before anything is built from them; records are checked against them by each reader.
    """
    def bad(field: str, value: Any, want: str) -> NoReturn:
        shown = repr(value) if not isinstance(value, tuple | dict) or len(value) <= 8 else f"{len(value)} entries"
        raise TraceSchemaError(f"{path}: record 0 (header): {field} = {shown}, expected {want}")

    m = header.model
    top_layer = MAX_LAYERS
    experts = MAX_EXPERTS
    if m is not None:
        if not 1 <= m.num_layers <= MAX_LAYERS:
            bad("model.num_layers", m.num_layers, f"1..{MAX_LAYERS}")
        if not 1 <= m.num_experts <= MAX_EXPERTS:
            bad("model.num_experts", m.num_experts, f"1..{MAX_EXPERTS}")
        if not 1 <= m.top_k <= m.num_experts:
            bad("model.top_k", m.top_k, f"1..num_experts ({m.num_experts})")
        if not 0 <= m.hidden_size <= MAX_HIDDEN:
            bad("model.hidden_size", m.hidden_size, f"0..{MAX_HIDDEN}")
        if (len(set(m.moe_layers)) != len(m.moe_layers)
                or not all(0 <= ly < m.num_layers for ly in m.moe_layers)):
            bad("model.moe_layers", m.moe_layers, f"distinct layers in 0..{m.num_layers - 1}")
        top_layer, experts = m.num_layers, m.num_experts  # the MTP head's MoE is layer num_layers
    if not all(0 <= ly <= top_layer for ly in header.layers):
        bad("layers", header.layers, f"layers in 0..{top_layer}")
    for layer, cap in header.capacities.items():
        if not 0 <= layer <= top_layer:
            bad("capacities", header.capacities, f"layers in 0..{top_layer}")
        if not 1 <= cap <= experts:
            bad(f"capacities[{layer}]", cap, f"1..{experts} slots")
    if isinstance(run := header.run, RunPart):
        if not 1 <= run.ranks <= MAX_RANKS:
            bad("run.ranks", run.ranks, f"1..{MAX_RANKS}")
        if not 0 <= run.rank < run.ranks:
            bad("run.rank", run.rank, f"0..run.ranks - 1 ({run.ranks - 1})")
        if not 0 <= run.lo <= run.hi <= top_layer:
            bad("run.lo, run.hi", (run.lo, run.hi), f"0 <= lo <= hi <= {top_layer}")
        if not 0 < len(run.id) <= 64:
            bad("run.id", run.id, "1 to 64 characters")


def iter_records(path: str | Path) -> Iterator[Header | Record | Footer]:
    """The header, then every record, then the footer, typed; TraceSchemaError names the file and record.

    Record 0 is the header. Raises TraceSchemaError for a file that is not a regular file, a
    newer schema, a header whose counts are out of bounds (`check_header`), a corrupt or
    truncated frame, a footer whose record count is not the file's, or a log without its footer.
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
                header = _HEADER_DECODER.decode(buf)
            except msgspec.DecodeError as e:
                raise TraceSchemaError(f"{p}: record 0 (header) is corrupt: {e}") from None
            check_header(p, header)
            yield header
            continue
        try:
            rec = _FRAME_DECODER.decode(buf)
        except msgspec.DecodeError as e:
            raise TraceSchemaError(f"{p}: record {n} is corrupt: {e}") from None
        if isinstance(rec, Footer):
            footer = True
            if rec.records != n - 1 or rec.dropped < 0:
                raise TraceSchemaError(f"{p}: record {n} (footer) counts {rec.records} records and {rec.dropped} "
                                       f"dropped; the file holds {n - 1} records")
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


__all__ = ["MAGIC", "MAX_EXPERTS", "MAX_FRAME", "MAX_HIDDEN", "MAX_LAYERS", "SCHEMA_VERSION", "TRACE_CAP", "Candidates", "Evicted", "RecallSample", "SpecRound", "UnionSize", "Footer", "Header",
           "PrefetchHint", "ModelShape", "ReadStarted", "Record", "RequestStart", "Route", "RunPart", "Stalled",
           "TraceWriter",
           "canonical", "check_header", "check_log_paths", "check_output_path", "iter_records", "read", "read_all",
           "route_record"]
