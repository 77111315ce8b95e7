"""An event log's timeline as Chrome trace events (JSON), the format Perfetto's UI and chrome://tracing open.

    doc = trace_events(timeline(header, records, (0, None)), log="run.qtrace")

The events come from `qnpipe.trace.timeline` (what `qnpipe trace plot` draws), so the two agree:

- process 1, "forward": a thread per MoE layer with its `compute` slices (granted to released) and
  its `stall` slices (waiting for reads, before the grant); a `steps` thread with a slice per step
  (its first event to the next step's); a `hints` thread with an instant at each `predict.hint` that
  asked for a read (the experts it had read in its args);
- process 2, "device": a thread per device lane (reads on the device at once take different lanes,
  `assign_lanes`, so the slices of a lane never overlap, as the format requires of one thread);
  each read a slice from the moment its batch went to the device to its completion, named by what
  became of it (`demand`, `prefetch in time`, `prefetch late`, `prefetch unused`), its layer,
  expert, hint, issue and need times in its args.

Times (`ts`, `dur`) are microseconds from the window's start (the trace format's unit); the JSON is
the object form, `{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from qnpipe._version import __version__
from qnpipe.io.atomic import atomic_file
from qnpipe.trace.timeline import Timeline

FORWARD_PID, DEVICE_PID = 1, 2
STEPS_TID, HINTS_TID = 0, 1  # the forward's layer threads follow, from LAYER_TID0
LAYER_TID0 = 10
READ_NAMES = {"demand": "demand", "in time": "prefetch in time", "late": "prefetch late", "unused": "prefetch unused"}


def _meta(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {"name" if "name" in name else "sort_index": value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def trace_events(tl: Timeline, *, log: str | Path = "log") -> dict[str, Any]:
    """The Chrome trace-event document of `tl` (see the module doc)."""

    def us(t: float) -> float:
        return round((t - tl.t0) * 1e6, 3)

    def dur(a: float, b: float) -> float:
        # of the rounded ends: a slice that ends where the next starts ends there to the nanosecond too
        return max(0.0, round(us(b) - us(a), 3))

    tid = {layer: LAYER_TID0 + i for i, layer in enumerate(tl.layers)}
    events: list[dict[str, Any]] = [
        _meta(FORWARD_PID, None, "process_name", "forward"), _meta(FORWARD_PID, None, "process_sort_index", 0),
        _meta(DEVICE_PID, None, "process_name", "device"), _meta(DEVICE_PID, None, "process_sort_index", 1),
        _meta(FORWARD_PID, STEPS_TID, "thread_name", "steps"), _meta(FORWARD_PID, STEPS_TID, "thread_sort_index", 0),
        _meta(FORWARD_PID, HINTS_TID, "thread_name", "hints"), _meta(FORWARD_PID, HINTS_TID, "thread_sort_index", 1),
    ]
    for layer, t in tid.items():
        events += [_meta(FORWARD_PID, t, "thread_name", f"layer {layer}"), _meta(FORWARD_PID, t, "thread_sort_index", t)]
    for lane in range(tl.lanes):
        events += [_meta(DEVICE_PID, lane, "thread_name", f"lane {lane}"),
                   _meta(DEVICE_PID, lane, "thread_sort_index", lane)]
    ends = [t for _, t in tl.step_starts[1:]] + [tl.t1]
    for (step, start), end in zip(tl.step_starts, ends, strict=True):
        events.append({"ph": "X", "pid": FORWARD_PID, "tid": STEPS_TID, "name": f"step {step}", "cat": "step",
                       "ts": us(start), "dur": dur(start, end), "args": {"step": step}})
    for c in tl.compute:
        events.append({"ph": "X", "pid": FORWARD_PID, "tid": tid[c.layer], "name": "compute", "cat": "compute",
                       "ts": us(c.start), "dur": dur(c.start, c.end),
                       "args": {"step": c.step, "layer": c.layer, "part": c.part}})
    for s in tl.stalls:
        events.append({"ph": "X", "pid": FORWARD_PID, "tid": tid[s.layer], "name": "stall", "cat": "stall",
                       "ts": us(s.start), "dur": dur(s.start, s.end),
                       "args": {"step": s.step, "layer": s.layer, "part": s.part, "misses": s.misses}})
    hints: dict[float, list[str]] = {}
    for r in tl.reads:
        name = READ_NAMES[r.outcome]
        args: dict[str, Any] = {"layer": r.layer, "expert": r.expert, "class": r.cls, "outcome": r.outcome,
                                "issued_ms": round((r.issued_t - tl.t0) * 1e3, 6),
                                "queued_ms": round((r.started_t - r.issued_t) * 1e3, 6)}
        if r.hint_t is not None:
            args["hint_ms"] = round((r.hint_t - tl.t0) * 1e3, 6)
            hints.setdefault(r.hint_t, []).append(f"{r.layer}:{r.expert}")
        if r.needed_t is not None:
            args["needed_ms"] = round((r.needed_t - tl.t0) * 1e3, 6)
            args["slack_ms"] = round((r.needed_t - r.done_t) * 1e3, 6)  # < 0: late by that much
        events.append({"ph": "X", "pid": DEVICE_PID, "tid": r.lane, "name": name, "cat": "read",
                       "ts": us(r.started_t), "dur": dur(r.started_t, r.done_t), "args": args})
    for t, experts in sorted(hints.items()):
        events.append({"ph": "i", "s": "t", "pid": FORWARD_PID, "tid": HINTS_TID, "name": "hint", "cat": "hint",
                       "ts": us(t), "args": {"experts": " ".join(experts)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"source": f"qnpipe {__version__}", "log": Path(log).name,
                         "steps": f"{tl.first}..{tl.last}", "clock": "trio clock, microseconds from the window's start"}}


def write(tl: Timeline, path: str | Path, *, log: str | Path = "log") -> Path:
    """Write `trace_events(tl)` as JSON to `path` (atomically, the usual file mode); the path."""
    with atomic_file(path) as f:
        f.write(msgspec.json.encode(trace_events(tl, log=log)))
    return Path(path)


__all__ = ["READ_NAMES", "trace_events", "write"]
