"""The timeline of a window of steps of an event log: compute, stalls and reads, laid out for drawing.

    tl = timeline(header, records, steps=(3, 6))   # steps 3, 4, 5

Pure functions of a log's records (a live run's or a replay's event log, docs/trace-format.md);
`qnpipe.trace.plot` draws the result. What each part comes from:

- compute of a layer-step part: its `pool.granted` (`t`) to its `pool.release` (`t`);
- a stall: `pool.stall`, the `waited_s` before its grant;
- a read: its `read.request` (issue time, class), `read.done` (`started_t`: its batch went to
  the device, `t`: done) and, for a prefetch, the `predict.hint` that asked for it (hint time)
  and the first `pool.acquire` of the expert after the issue (when the forward needed it);
  a prefetch is `in time` when done by then, `late` when not, `unused` when nothing needed it
  before the expert was read again or the log ended;
- a device lane: reads on the device at once take different lanes (`assign_lanes`), so the
  number of lanes is the peak number of reads between their start and completion.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import msgspec

from qnpipe.errors import QnpipeError, TraceSchemaError
from qnpipe.messages import Acquire, ForwardDone, Granted, PrefetchHint, ReadClass, ReadDone, ReadExpert, Release
from qnpipe.trace.format import Header, Record, Stalled

DEFAULT_STEPS = 4  # a window of the first four steps when none is given


class Compute(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    layer: int
    part: int
    start: float
    end: float


class Stall(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    layer: int
    part: int
    start: float
    end: float
    misses: int


class Read(msgspec.Struct, frozen=True, kw_only=True):
    layer: int
    expert: int
    cls: str  # "demand", "prefetch", ... (ReadClass names, lower case)
    hint_t: float | None  # the predict.hint that asked for it (prefetches)
    issued_t: float
    started_t: float
    done_t: float
    needed_t: float | None  # the first pool.acquire of the expert after the issue (before it was read again)
    outcome: str  # "demand", "in time", "late", "unused"
    lane: int = 0


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    """Steps `first`..`last` between `t0` and `t1` (trio clock, s), with what happened in them."""

    first: int
    last: int
    t0: float
    t1: float
    step_starts: list[tuple[int, float]]
    layers: list[int]  # MoE layers with compute or stalls in the window, in order
    compute: list[Compute]
    stalls: list[Stall]
    reads: list[Read]  # overlapping the window, with their lanes
    lanes: int


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`A:B` (the steps numbered A to B-1: half-open like a Python slice, but of step numbers, which count from
    1 as the log numbers them, not of 0-based positions; `A:` from A on, `:B` before B, `:` all) or `A` (step A)."""
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo.strip() else None
        b = int(hi) if hi.strip() else None
    except ValueError:
        raise QnpipeError(f"--steps {text!r}: expected A:B (integers, steps count from 1), e.g. 3:6") from None
    if not sep:
        if a is None:
            raise QnpipeError(f"--steps {text!r}: expected A:B or A")
        b = a + 1
    elif a is None and b is None:
        a = 1  # ":" is every step, not the default window
    if (a is not None and a < 1) or (b is not None and b < 1) or (a is not None and b is not None and b <= a):
        raise QnpipeError(f"--steps {text!r}: an empty window (steps count from 1, and B must exceed A)")
    return a, b


def assign_lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """A lane per interval so that intervals in one lane do not overlap (one may start when another
    ends); each takes the lowest free lane in order of start (ties: input order). As few lanes as
    the peak overlap."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1], i))
    ends: list[float] = []
    lanes = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        lane = next((k for k, free_at in enumerate(ends) if free_at <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        lanes[i] = lane
    return lanes


def _reads(records: Sequence[Record]) -> list[Read]:
    requests: dict[tuple[int, int, int, float], ReadExpert] = {}
    hint_t: dict[tuple[int, int], float] = {}
    hinted: dict[tuple[int, int, int, float], float] = {}
    acquires: dict[tuple[int, int], list[float]] = {}
    issues: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if isinstance(r, PrefetchHint):
            for e in r.experts:
                hint_t[(r.layer, e)] = r.t
        elif isinstance(r, ReadExpert):
            key = (r.layer, r.expert, r.slot, r.t)
            requests[key] = r
            issues.setdefault((r.layer, r.expert), []).append(r.t)
            if r.cls is ReadClass.PREFETCH and (r.layer, r.expert) in hint_t:
                hinted[key] = hint_t[(r.layer, r.expert)]
        elif isinstance(r, Acquire):
            for e in r.experts:
                acquires.setdefault((r.layer, e), []).append(r.t)
    for ts in (*acquires.values(), *issues.values()):
        ts.sort()
    out = []
    for r in records:
        if not isinstance(r, ReadDone):
            continue
        key = (r.layer, r.expert, r.slot, r.issued_t)
        req = requests.get(key)
        cls = req.cls if req is not None else ReadClass.DEMAND
        needed = None
        if cls is not ReadClass.DEMAND:
            later = issues.get((r.layer, r.expert), [])
            nxt = bisect.bisect_right(later, r.issued_t)
            until = later[nxt] if nxt < len(later) else math.inf
            asks = acquires.get((r.layer, r.expert), [])
            j = bisect.bisect_left(asks, r.issued_t)
            if j < len(asks) and asks[j] < until:
                needed = asks[j]
        if cls is ReadClass.DEMAND:
            outcome = "demand"
        elif needed is None:
            outcome = "unused"
        else:
            outcome = "in time" if r.t <= needed else "late"
        out.append(Read(layer=r.layer, expert=r.expert, cls=cls.name.lower(), hint_t=hinted.get(key),
                        issued_t=r.issued_t, started_t=r.started_t, done_t=r.t, needed_t=needed, outcome=outcome))
    return out


def timeline(header: Header, records: Sequence[Record], steps: tuple[int | None, int | None] = (None, None),
             *, path: str = "log") -> Timeline:
    """The window `steps` (half-open, from `parse_steps`; default the first DEFAULT_STEPS) of an event log.

    Raises TraceSchemaError when the log has no timing to draw (a routing log, or a run without
    a pipeline) and QnpipeError when the window holds none of the log's steps."""
    span: dict[int, list[float]] = {}
    for r in records:
        step = getattr(r, "step", None)
        if isinstance(step, int) and isinstance(r, Granted | Release | Acquire | ForwardDone):
            lo_hi = span.setdefault(step, [r.t, r.t])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], r.t), max(lo_hi[1], r.t)
    if not span:
        what = "a routing log" if header.contents == "routes" else "an event log without pipeline events"
        raise TraceSchemaError(f"{path}: {what}: no pool.acquire/granted/release records, so no timing to draw "
                               f"(write one with `qnpipe generate --trace` or `qnpipe replay --set "
                               f"trace.event_log_path=FILE`)")
    known = sorted(span)
    a, b = steps
    first = a if a is not None else known[0]
    stop = b if b is not None else (first + DEFAULT_STEPS if a is None else known[-1] + 1)
    inside = [s for s in known if first <= s < stop]
    if not inside:
        raise QnpipeError(f"{path}: steps {first}:{stop} hold none of the log's steps ({known[0]}..{known[-1]})")
    first, last = inside[0], inside[-1]
    t0, t1 = span[first][0], max(span[s][1] for s in inside)
    grants = {(r.step, r.layer, r.part): r.t for r in records if isinstance(r, Granted) and first <= r.step <= last}
    compute = [Compute(step=r.step, layer=r.layer, part=r.part, start=grants[(r.step, r.layer, r.part)], end=r.t)
               for r in records if isinstance(r, Release) and (r.step, r.layer, r.part) in grants]
    stalls = [Stall(step=r.step, layer=r.layer, part=r.part, start=r.t - r.waited_s, end=r.t, misses=r.misses)
              for r in records if isinstance(r, Stalled) and first <= r.step <= last]
    reads = [x for x in _reads(records) if (x.hint_t if x.hint_t is not None else x.issued_t) <= t1 and x.done_t >= t0]
    lanes = assign_lanes([(x.started_t, x.done_t) for x in reads])
    reads = [msgspec.structs.replace(x, lane=lane) for x, lane in zip(reads, lanes, strict=True)]
    layers = sorted({c.layer for c in compute} | {s.layer for s in stalls})
    return Timeline(first=first, last=last, t0=t0, t1=t1, step_starts=[(s, span[s][0]) for s in inside],
                    layers=layers, compute=compute, stalls=stalls, reads=reads, lanes=max(lanes, default=-1) + 1)


__all__ = ["DEFAULT_STEPS", "Compute", "Read", "Stall", "Timeline", "assign_lanes", "parse_steps", "timeline"]
