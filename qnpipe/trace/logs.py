"""The logs a configuration asks for, opened and written without a clock or a task.

`wanted_logs(cfg)` says which logs (`trace.event_log_path`: every event;
`trace.route_trace`: the `Route` records of `trace.route_trace_layers`), `open_writers`
opens them with their headers, and `write_event` writes one event (a `Granted` with misses
is followed by its derived `Stalled`). The live recorder (qnpipe.actors.recorder) writes
through these from its trio task; replay's heap driver (qnpipe.replay.fast) through
`SyncLogs`, at once, in the order the events come.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import msgspec

from qnpipe.config import Config
from qnpipe.messages import Granted, Msg
from qnpipe.trace.format import SCHEMA_VERSION, Header, ModelShape, Record, Route, RunPart, Stalled, TraceWriter

Accept = Callable[[Msg], bool]


@attrs.frozen
class LogSpec:
    path: str
    contents: str  # "events" or "routes"
    accept: Accept | None  # None = every event
    layers: tuple[int, ...]


def route_filter(layers: tuple[int, ...]) -> Accept:
    wanted = set(layers)

    def accept(ev: Msg) -> bool:
        return isinstance(ev, Route) and (not wanted or ev.layer in wanted)

    return accept


def wanted_logs(cfg: Config) -> list[LogSpec]:
    trace_cfg = cfg.trace
    out = []
    if trace_cfg.event_log_path:
        out.append(LogSpec(trace_cfg.event_log_path, "events", None, ()))
    if trace_cfg.route_trace:
        layers = trace_cfg.route_trace_layers
        out.append(LogSpec(trace_cfg.route_trace_path, "routes", route_filter(layers), layers))
    return out


def open_writers(cfg: Config, specs: list[LogSpec], *, shape: ModelShape | None, capacities: dict[int, int] | None,
                 clock_start_t: float, wall_start_unix_s: float, run: RunPart | None = None) -> list[TraceWriter]:
    """A writer per log with its header (`run`: a distributed run's rank); on a failure the ones opened are
    abandoned (nothing left)."""
    fingerprint = cfg.fingerprint()
    writers: list[TraceWriter] = []
    try:
        for s in specs:
            header = Header(schema_version=SCHEMA_VERSION, fingerprint=fingerprint, model=shape,
                            clock_start_t=clock_start_t, wall_start_unix_s=wall_start_unix_s, contents=s.contents,
                            layers=s.layers, capacities=dict(capacities or {}), evict_policy=str(cfg.pool.evict_policy),
                            run=msgspec.UNSET if run is None else run)
            writers.append(TraceWriter(s.path, header))
    except BaseException:
        for w in writers:
            w.abandon()
        raise
    return writers


def write_event(writer: TraceWriter, ev: Record) -> None:
    writer.write(ev)
    if isinstance(ev, Granted) and ev.misses:
        writer.write(Stalled(t=ev.t, seq=ev.seq, step=ev.step, layer=ev.layer, part=ev.part, misses=ev.misses,
                             waited_s=ev.waited_s))


class SyncLogs:
    """The configured logs written as events come (`emit`), closed with the run's end time (`close`)."""

    def __init__(self, cfg: Config, *, shape: ModelShape | None, capacities: dict[int, int] | None,
                 clock_start_t: float = 0.0) -> None:
        specs = wanted_logs(cfg)
        self._logs = list(zip(open_writers(cfg, specs, shape=shape, capacities=capacities,
                                           clock_start_t=clock_start_t, wall_start_unix_s=0.0),
                              [s.accept for s in specs], strict=True))

    def emit(self, ev: Msg) -> None:
        for w, accept in self._logs:
            if accept is None or accept(ev):
                write_event(w, ev)  # type: ignore[arg-type]  # every emitted Msg is a Record

    def close(self, clock_end_t: float) -> None:
        for w, _ in self._logs:
            w.close(0, clock_end_t)

    def abandon(self) -> None:
        for w, _ in self._logs:
            w.abandon()


__all__ = ["LogSpec", "SyncLogs", "open_writers", "route_filter", "wanted_logs", "write_event"]
