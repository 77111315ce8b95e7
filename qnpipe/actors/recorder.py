"""The recorder: the single writer of the event log (and of the routing log), format in qnpipe.trace.

Actors get an `emit` callable (an `Emitter`); it puts each event on a bounded channel
with `send_nowait` and never blocks: when a channel is full (or already closed) the
event is counted as dropped, and the count goes in the log's footer and the recorder's
statistics. The channel is sized so that nothing drops in a normal run: the forward
yields to the scheduler at least once per layer-step (it waits for its grant or the MLX
thread), and one layer-step emits at most a handful of records per expert it reads.

Records are written in the order they arrive, which on one trio loop is a causal order
(an event is emitted before what it causes is sent). `Granted` records with misses are
followed by a derived `Stalled` record. The file is flushed every `flush_every_s` of
trio time and renamed into place when the recorder stops (qnpipe.trace.TraceWriter).

A log that cannot be written (a full disk, EFBIG, an I/O error) stops only that log: its
recorder removes the partial file and keeps the OutputError (naming the log's path), and the
next record the model's own task emits (a `trace.route`, at its next MoE router) raises it
there, so the generation in flight fails with it and the caller sees it. The pool and the
read scheduler are never raised into: the engine stays usable and later generations run
without that log. An error nobody was raised into (the log failed while closing) is raised
by `open_recording` when its block ends. Nothing waits on the recorder, so a failed disk
cannot hang the run.

With no trace configured, `open_recording` yields None and no recorder runs.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import attrs
import msgspec
import trio

from qnpipe.actors.stamp import drain
from qnpipe.config import Config
from qnpipe.errors import OutputError
from qnpipe.messages import Candidates, Msg
from qnpipe.trace import ModelShape, Record, Route, SpecRound, TraceWriter, UnionSize
from qnpipe.trace.format import RunPart
from qnpipe.trace.logs import open_writers, wanted_logs, write_event

Emit = Callable[[Msg], None]


class RecorderStats(msgspec.Struct, frozen=True, kw_only=True):
    """One log's figures: records written, events dropped because its channel was full or closed."""

    path: str
    records: int
    dropped: int


# The records the model's own task emits (the forward, the speculation loop): a failed log's
# error is raised into that task only, never into the pool or the read scheduler.
_RAISED_ON = (Route, Candidates, UnionSize, SpecRound)


@attrs.define(eq=False)
class _Sink:
    tx: trio.MemorySendChannel[Record]
    rx: trio.MemoryReceiveChannel[Record]
    accept: Callable[[Msg], bool] | None  # None = every event
    writer: TraceWriter
    dropped: int = 0
    failure: OutputError | None = None  # the log could not be written: it is stopped
    raised: bool = False  # `failure` reached a caller


class Emitter:
    """`emit(event)`: hand an event to every recorder that wants it, never blocking (drops are counted).

    Once a log has failed, the first of the model task's own records (`_RAISED_ON`) emitted
    after it raises its OutputError; the log takes no more events.
    """

    def __init__(self, sinks: list[_Sink]) -> None:
        self._sinks = sinks

    def __call__(self, ev: Msg) -> None:
        failed: _Sink | None = None
        for s in self._sinks:
            if s.failure is not None:
                failed = failed or (s if not s.raised else None)
                continue
            if s.accept is not None and not s.accept(ev):
                continue
            try:
                s.tx.send_nowait(ev)  # type: ignore[arg-type]  # every emitted Msg is a Record
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                s.dropped += 1
        if failed is not None and isinstance(ev, _RAISED_ON):
            failed.raised = True
            assert failed.failure is not None
            raise failed.failure

    def unraised(self) -> OutputError | None:
        """The first log failure no caller has seen yet (None: none)."""
        for s in self._sinks:
            if s.failure is not None and not s.raised:
                s.raised = True
                return s.failure
        return None

    def statistics(self) -> list[RecorderStats]:
        return [RecorderStats(path=str(s.writer.path), records=s.writer.records, dropped=s.dropped)
                for s in self._sinks]


async def recorder(
    inbox: trio.MemoryReceiveChannel[Record],
    *,
    sink: _Sink,
    flush_every_s: float = 1.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Write every event of `inbox` until it closes; then (or when cancelled) write the footer and rename.

    A write that fails ends the recorder at once: the partial file is removed and the
    OutputError kept in `sink.failure` (the Emitter raises it to the model's task). It never
    propagates here, where it would cancel the whole pipeline around the caller's generation.
    """
    writer = sink.writer
    task_status.started()
    finished = False
    try:
        next_flush = trio.current_time() + flush_every_s
        async for first in inbox:
            for ev in drain(inbox, first):
                write_event(writer, ev)
            if trio.current_time() >= next_flush:
                writer.flush()
                next_flush = trio.current_time() + flush_every_s
        finished = True
    except OutputError as e:
        sink.failure = e
    finally:
        # Shielded and bounded: the log is completed even while the pipeline is being cancelled.
        with trio.move_on_after(1, shield=True):
            if sink.failure is None:
                try:
                    if not finished:
                        for ev in _rest(inbox):
                            write_event(writer, ev)
                    writer.close(sink.dropped, trio.current_time())
                except OutputError as e:
                    sink.failure = e
            await trio.lowlevel.checkpoint()
        writer.abandon()  # no-op once closed; else removes the partial file
        inbox.close()


def _rest(inbox: trio.MemoryReceiveChannel[Record]) -> list[Record]:
    out: list[Record] = []
    while True:
        try:
            out.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return out


@asynccontextmanager
async def open_recording(cfg: Config, *, shape: ModelShape | None, capacities: dict[int, int] | None,
                         channel_size: int, wall_start_unix_s: float = 0.0,
                         run: RunPart | None = None) -> AsyncIterator[Emitter | None]:
    """Start a recorder per configured log and yield the `Emitter` for the actors (None: nothing configured).

    `wall_start_unix_s` goes in the header for humans only; the caller reads the wall clock
    (the live engine does, replay leaves 0), so nothing here depends on it. `run`: this rank's part of a
    distributed run, in the header too (`trace merge` takes the logs of one run only).

    `trace.event_log_path` gets every event; `trace.route_trace` writes `trace.route_trace_path`
    with only the `Route` records of `trace.route_trace_layers` (empty = all layers). Leaving
    the block closes the channels, so each recorder writes its footer and renames its file.
    """
    specs = wanted_logs(cfg)
    if not specs:
        yield None
        return
    writers = open_writers(cfg, specs, shape=shape, capacities=capacities, clock_start_t=trio.current_time(),
                           wall_start_unix_s=wall_start_unix_s, run=run)
    sinks = []
    for spec, writer in zip(specs, writers, strict=True):
        tx, rx = trio.open_memory_channel[Record](channel_size)
        sinks.append(_Sink(tx, rx, spec.accept, writer))
    emitter = Emitter(sinks)
    async with trio.open_nursery() as nursery:
        for s in sinks:
            await nursery.start(partial(recorder, s.rx, sink=s))
        try:
            yield emitter
        finally:
            for s in sinks:
                s.tx.close()
    for s, st in zip(sinks, emitter.statistics(), strict=True):
        if st.dropped and s.failure is None:
            warnings.warn(f"{st.path}: {st.dropped} events were dropped (the recorder's channel was full)",
                          stacklevel=2)
    if (failure := emitter.unraised()) is not None:
        raise failure


__all__ = ["Emit", "Emitter", "RecorderStats", "open_recording", "recorder"]
