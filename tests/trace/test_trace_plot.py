"""`qnpipe trace plot`: the timeline of a window of steps (pure functions) and its PNG."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import QnpipeError, TraceSchemaError
from qnpipe.messages import Acquire, ForwardDone, Granted, PrefetchHint, ReadDone, ReadExpert, Release
from qnpipe.policy.read_queue import ReadClass
from qnpipe.replay import replay
from qnpipe.trace.timeline import assign_lanes, parse_steps, timeline

SHAPE = trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, hidden_size=4)


def _write(path: Path, records: list[trace.Record], contents: str = "events") -> Path:
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=SHAPE,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents=contents))
    for r in records:
        w.write(r)
        if isinstance(r, Granted) and r.misses:  # as the recorder does
            w.write(trace.Stalled(t=r.t, seq=r.seq, step=r.step, layer=r.layer, part=r.part, misses=r.misses,
                                  waited_s=r.waited_s))
    w.close(0, records[-1].t)
    return path


def _grant(t: float, step: int, layer: int, experts: tuple[int, ...], misses: int, waited: float) -> Granted:
    return Granted(t=t, seq=0, step=step, layer=layer, part=0, experts=experts, slots=(0, 1), generations=(1, 1),
                   hits=len(experts) - misses, misses=misses, waited_s=waited)


def _prefetch(t: float, expert: int, slot: int) -> ReadExpert:
    return ReadExpert(t=t, seq=0, layer=1, expert=expert, slot=slot, cls=ReadClass.PREFETCH, deadline=2.0)


# Step 1: layer 0 waits 1 s for two demand reads; a hint at 0.5 s prefetches experts 3, 4, 5 of
# layer 1, which the forward asks for (3 and 4) at 2.0 s: 3 is done at 1.5 (in time), 4 at 2.5
# (late), 5 is never asked for (unused). Step 2: layer 0 hits.
RECORDS: list[trace.Record] = [
    Acquire(t=0.0, seq=0, step=1, layer=0, part=0, experts=(1, 2)),
    ReadExpert(t=0.0, seq=0, layer=0, expert=1, slot=0),
    ReadExpert(t=0.0, seq=1, layer=0, expert=2, slot=1),
    PrefetchHint(t=0.5, seq=0, step=1, source=0, layer=1, experts=(3, 4, 5), scores=(1.0, 0.5, 0.2), deadline=2.0),
    _prefetch(0.5, 3, 4), _prefetch(0.5, 4, 5), _prefetch(0.5, 5, 6),
    ReadDone(t=1.0, seq=0, layer=0, expert=1, slot=0, nbytes=10, issued_t=0.0, started_t=0.0),
    ReadDone(t=1.0, seq=1, layer=0, expert=2, slot=1, nbytes=10, issued_t=0.0, started_t=0.0),
    _grant(1.0, 1, 0, (1, 2), misses=2, waited=1.0),
    ReadDone(t=1.5, seq=2, layer=1, expert=3, slot=4, nbytes=10, issued_t=0.5, started_t=1.0),
    Release(t=2.0, seq=0, step=1, layer=0, part=0),
    Acquire(t=2.0, seq=1, step=1, layer=1, part=0, experts=(3, 4)),
    ReadDone(t=2.5, seq=3, layer=1, expert=4, slot=5, nbytes=10, issued_t=0.5, started_t=1.5),
    _grant(2.5, 1, 1, (3, 4), misses=1, waited=0.5),
    ReadDone(t=3.0, seq=4, layer=1, expert=5, slot=6, nbytes=10, issued_t=0.5, started_t=1.5),
    Release(t=4.0, seq=1, step=1, layer=1, part=0),
    ForwardDone(t=4.0, seq=2, step=1),
    Acquire(t=4.0, seq=3, step=2, layer=0, part=0, experts=(1, 2)),
    _grant(4.0, 2, 0, (1, 2), misses=0, waited=0.0),
    Release(t=5.0, seq=3, step=2, layer=0, part=0),
    ForwardDone(t=6.0, seq=4, step=2),
]


@pytest.fixture
def hand_log(tmp_path: Path) -> Path:
    return _write(tmp_path / "hand.qtrace", RECORDS)


def test_lanes_go_to_the_lowest_free_lane_in_order_of_start() -> None:
    assert assign_lanes([(0, 1), (0, 2), (1, 3), (2, 3), (0.5, 0.6)]) == [0, 1, 0, 1, 2]
    assert assign_lanes([]) == []


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)), max_size=40))
def test_lanes_never_overlap_and_number_the_peak_overlap(spans: list[tuple[int, int]]) -> None:
    intervals = [(float(a), float(a + d)) for a, d in spans]
    lanes = assign_lanes(intervals)
    for lane in set(lanes):
        mine = sorted(iv for iv, ln in zip(intervals, lanes, strict=True) if ln == lane)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:], strict=False))
    # the peak number of intervals open at once (an interval ending at t is closed when another starts at t)
    events = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    peak = depth = 0
    for _, d in events:
        depth += d
        peak = max(peak, depth)
    positive = [ln for (s, e), ln in zip(intervals, lanes, strict=True) if e > s]
    assert (max(positive) + 1 if positive else 0) == peak


@pytest.mark.parametrize(("text", "window"), [("3:6", (3, 6)), ("3", (3, 4)), ("3:", (3, None)),
                                              (":4", (None, 4)), (":", (1, None))])
def test_steps_parse_as_a_slice(text: str, window: tuple[int | None, int | None]) -> None:
    assert parse_steps(text) == window


@pytest.mark.parametrize("text", ["a:b", "0:2", "5:5", "6:3", ""])
def test_bad_steps_fail_naming_them(text: str) -> None:
    with pytest.raises(QnpipeError, match="--steps"):
        parse_steps(text)


def test_reads_get_their_hint_issue_need_and_outcome(hand_log: Path) -> None:
    header, records = trace.read(hand_log)
    tl = timeline(header, records, (1, 2))
    assert (tl.first, tl.last, tl.t0, tl.t1) == (1, 1, 0.0, 4.0)
    got = {(r.layer, r.expert): (r.cls, r.hint_t, r.issued_t, r.started_t, r.done_t, r.needed_t, r.outcome, r.lane)
           for r in tl.reads}
    assert got == {
        (0, 1): ("demand", None, 0.0, 0.0, 1.0, None, "demand", 0),
        (0, 2): ("demand", None, 0.0, 0.0, 1.0, None, "demand", 1),
        (1, 3): ("prefetch", 0.5, 0.5, 1.0, 1.5, 2.0, "in time", 0),
        (1, 4): ("prefetch", 0.5, 0.5, 1.5, 2.5, 2.0, "late", 0),
        (1, 5): ("prefetch", 0.5, 0.5, 1.5, 3.0, None, "unused", 1),
    }
    assert tl.lanes == 2 and tl.layers == [0, 1]
    assert [(c.layer, c.start, c.end) for c in tl.compute] == [(0, 1.0, 2.0), (1, 2.5, 4.0)]
    assert [(s.layer, s.start, s.end, s.misses) for s in tl.stalls] == [(0, 0.0, 1.0, 2), (1, 2.0, 2.5, 1)]


def test_the_window_keeps_only_its_steps_and_the_reads_that_overlap_it(hand_log: Path) -> None:
    header, records = trace.read(hand_log)
    late = timeline(header, records, (2, None))
    assert (late.first, late.last, late.t0, late.t1) == (2, 2, 4.0, 6.0)
    assert late.reads == [] and late.stalls == [] and [c.step for c in late.compute] == [2]
    whole = timeline(header, records)  # default: the first steps
    assert (whole.first, whole.last, len(whole.reads), len(whole.compute)) == (1, 2, 5, 3)
    assert [s for s, _ in whole.step_starts] == [1, 2]
    with pytest.raises(QnpipeError, match=r"steps 7:9 hold none of the log's steps \(1..2\)"):
        timeline(header, records, (7, 9))


def test_a_routing_log_has_no_timing_to_draw(tmp_path: Path) -> None:
    path = _write(tmp_path / "routes.qtrace", [trace.Route(t=0.0, seq=0, step=1, layer=0, top_k=2, experts=(1, 2))],
                  contents="routes")
    header, records = trace.read(path)
    with pytest.raises(TraceSchemaError, match="a routing log: .*no timing"):
        timeline(header, records, path=str(path))
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def _png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
        return im.size


def test_a_plot_of_a_small_log_is_a_png(hand_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hand.png"
    assert main(["trace", "plot", str(hand_log), "-o", str(out), "--steps", "1:3"]) == 0
    w, h = _png_size(out)
    assert w > 800 and h > 200
    assert "steps 1..2, 2 layers, 5 reads on 2 lanes (1 late prefetches), 2 stalls" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.partial"))


def test_a_plot_of_a_replays_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(2)
    routes = _write(tmp_path / "routes.qtrace",
                    [trace.Route(t=0.0, seq=i, step=1 + i // 2, layer=i % 2, top_k=2,
                                 experts=tuple(rng.sample(range(8), 2))) for i in range(24)], contents="routes")
    events = tmp_path / "events.qtrace"
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": 3, "trace.event_log_path": str(events)})
    r = replay(routes, cfg, record_nbytes=1 << 20)
    header, records = trace.read(events)
    tl = timeline(header, records, (2, 5))
    assert (tl.first, tl.last, tl.layers) == (2, 4, [0, 1])
    assert tl.reads and all(x.outcome == "demand" and x.started_t <= x.done_t for x in tl.reads)
    assert len(tl.stalls) == sum(1 for x in records if isinstance(x, trace.Stalled) and 2 <= x.step <= 4)
    assert r.reads == sum(1 for x in records if isinstance(x, ReadDone))
    out = tmp_path / "events.png"
    assert main(["trace", "plot", str(events), "-o", str(out), "--steps", "2:5"]) == 0
    _png_size(out)
    assert "steps 2..4" in capsys.readouterr().out


def test_help_teaches_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["trace", "plot", "--help"])
    out = capsys.readouterr().out
    assert "usage: qnpipe trace plot" in out and "examples:" in out and "--steps" in out


@pytest.fixture(scope="module")
def live_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The event log of a live run of a streamed tiny model with prefetch on."""
    import contextlib
    import io

    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("live")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides={
        "num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2})
    convert(hf, root / "q")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", str(root / "q"), "--tokens", "5,6,7,8,9", "-n", "10", "--json",
                     "--set", "pool.expert_slots=4", "--set", "predict.cross_layer_prefetch=true",
                     "--trace", str(root / "run.qtrace")]) == 0
    return root / "run.qtrace"


def test_a_live_runs_prefetches_are_drawn_with_their_hints(live_log: Path, tmp_path: Path) -> None:
    header, records = trace.read(live_log)
    tl = timeline(header, records, (1, None))
    prefetches = [r for r in tl.reads if r.cls == "prefetch"]
    assert prefetches and all(r.hint_t is not None and r.hint_t <= r.issued_t for r in prefetches)
    assert {r.outcome for r in prefetches} <= {"in time", "late", "unused"}
    assert all(r.issued_t <= r.started_t <= r.done_t for r in tl.reads)
    assert all(r.needed_t is None or r.needed_t >= r.issued_t for r in tl.reads)
    issued = sum(1 for x in records if isinstance(x, ReadExpert) and x.cls is ReadClass.PREFETCH)
    done = {(x.layer, x.expert, x.issued_t) for x in records if isinstance(x, ReadDone)}
    assert len(prefetches) == sum(1 for x in records if isinstance(x, ReadExpert) and x.cls is ReadClass.PREFETCH
                                  and (x.layer, x.expert, x.t) in done) <= issued
    for lane in range(tl.lanes):
        mine = sorted((r.started_t, r.done_t) for r in tl.reads if r.lane == lane)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:], strict=False))
    out = tmp_path / "live.png"
    assert main(["trace", "plot", str(live_log), "-o", str(out), "--steps", "2:5"]) == 0
    _png_size(out)


# --- `qnpipe trace export --perfetto`: the timeline as Chrome trace events --------------------------------

PHASES = {"X", "i", "M"}  # what the export writes: complete slices, instants, metadata
META_NAMES = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
              "thread_sort_index": "sort_index"}


def _check_trace_events(doc: object) -> list[dict[str, Any]]:
    """The Chrome trace-event format's rules (the JSON object form) that Perfetto's JSON importer relies on;
    the events. Slices of one thread must nest (none may end inside another it started in): the importer
    drops or misplaces those that do not."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] in ("ms", "ns")
    events = doc["traceEvents"]
    for e in events:
        assert isinstance(e, dict) and e["ph"] in PHASES and isinstance(e["name"], str) and e["name"]
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int)
        if e["ph"] == "M":
            assert set(e["args"]) == {META_NAMES[e["name"]]}
            continue
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0 and isinstance(e.get("args", {}), dict)
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0
        else:
            assert e["s"] in ("t", "p", "g")
    by_thread: dict[tuple[object, object], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    for thread, spans in by_thread.items():
        open_ends: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-6:  # to the nanosecond the importer keeps
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-6, f"{thread}: slices overlap without nesting at {start}"
            open_ends.append(end)
    return events


def _slice_counts(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e["ph"] in ("X", "i"):
            counts[str(e["name"])] = counts.get(str(e["name"]), 0) + 1
    return counts


def test_an_export_of_the_hand_log_names_each_read_by_its_fate(hand_log: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = tmp_path / "hand.json"
    assert main(["trace", "export", str(hand_log), "--perfetto", str(out)]) == 0
    assert "2 stall slices" in capsys.readouterr().out
    events = _check_trace_events(json.loads(out.read_text()))
    assert _slice_counts(events) == {"step 1": 1, "step 2": 1, "compute": 3, "stall": 2, "demand": 2,
                                     "prefetch in time": 1, "prefetch late": 1, "prefetch unused": 1, "hint": 1}
    late = next(e for e in events if e["name"] == "prefetch late")
    # expert 4: hinted and issued at 0.5 s, on the device 1.5..2.5 s, needed at 2.0 s: 0.5 s late
    assert late["ts"] == 1.5e6 and late["dur"] == 1e6 and late["pid"] == 2
    assert late["args"] == {"layer": 1, "expert": 4, "class": "prefetch", "outcome": "late", "issued_ms": 500.0,
                            "queued_ms": 1000.0, "hint_ms": 500.0, "needed_ms": 2000.0, "slack_ms": -500.0}
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["name"] in ("thread_name", "process_name")}
    assert names[(1, None)] == "forward" and names[(2, None)] == "device" and "layer 1" in names.values()


def _trace_processor() -> str | None:
    """The trace processor binary the `perfetto` package would run, when it is on this machine (it downloads it
    on first use, which an offline machine cannot)."""
    import shutil

    try:
        from perfetto.prebuilts.manifests.trace_processor_shell import TRACE_PROCESSOR_SHELL_MANIFEST  # pyright: ignore[reportMissingImports]  # the test extra has it; a bare install does not
    except ImportError:
        return None
    found = shutil.which("trace_processor_shell")
    if found:
        return found
    import platform
    import sys

    for entry in TRACE_PROCESSOR_SHELL_MANIFEST:
        if entry.get("platform") == sys.platform and platform.machine().lower() in entry.get("machine", []):
            root, ext = Path(entry["file_name"]).stem, Path(entry["file_name"]).suffix
            cached = Path.home() / ".local/share/perfetto/prebuilts" / f"{root}-{entry['sha256'][:16]}{ext}"
            return str(cached) if cached.exists() else None
    return None


@pytest.fixture(scope="module")
def live_export(live_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import contextlib
    import io

    out = tmp_path_factory.mktemp("export") / "live.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["trace", "export", str(live_log), "--perfetto", str(out)]) == 0
    return out


def _live_counts(live_log: Path) -> dict[str, int]:
    """The slices a live log's export must hold, counted from its records."""
    from qnpipe.trace.format import Stalled

    _, records = trace.read(live_log)
    return {"compute": sum(1 for r in records if isinstance(r, Release)),
            "stall": sum(1 for r in records if isinstance(r, Stalled)),
            "reads": sum(1 for r in records if isinstance(r, ReadDone)),
            "steps": len({r.step for r in records if isinstance(r, Release)})}


def _summed(counts: dict[str, int]) -> dict[str, int]:
    return {"compute": counts["compute"], "stall": counts.get("stall", 0),
            "reads": sum(counts.get(n, 0) for n in ("demand", "prefetch in time", "prefetch late", "prefetch unused")),
            "steps": sum(v for k, v in counts.items() if k.startswith("step "))}


def test_a_live_runs_export_holds_every_slice_of_its_log(live_log: Path, live_export: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import json

    counts = _slice_counts(_check_trace_events(json.loads(live_export.read_text())))
    assert _summed(counts) == _live_counts(live_log)
    assert counts.get("prefetch in time", 0) + counts.get("prefetch late", 0) > 0  # prefetch was on
    # the windowed export keeps only its steps
    part = tmp_path / "part.json"
    assert main(["trace", "export", str(live_log), "--perfetto", str(part), "--steps", "2:4"]) == 0
    capsys.readouterr()
    assert {k for k in _slice_counts(_check_trace_events(json.loads(part.read_text()))) if k.startswith("step ")} \
        == {"step 2", "step 3"}


def test_the_format_check_refuses_slices_that_do_not_nest() -> None:
    def x(ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "pid": 1, "tid": 0, "name": "s", "ts": ts, "dur": dur}

    _check_trace_events({"traceEvents": [x(0, 10), x(2, 3), x(10, 5)], "displayTimeUnit": "ms"})  # nested, adjacent
    with pytest.raises(AssertionError, match="overlap without nesting"):
        _check_trace_events({"traceEvents": [x(0, 10), x(5, 10)], "displayTimeUnit": "ms"})


def test_a_live_runs_export_loads_in_perfettos_trace_processor(live_log: Path, live_export: Path) -> None:
    import json

    binary = _trace_processor()
    if binary is None:
        pytest.skip("perfetto's trace processor is not on this machine (the package downloads it on first use, "
                    "offline it cannot): test_a_live_runs_export_holds_every_slice_of_its_log checks the format")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig  # pyright: ignore[reportMissingImports]

    tp = TraceProcessor(trace=str(live_export), config=TraceProcessorConfig(bin_path=binary))
    try:
        rows = tp.query("select name, count(*) as n from slice group by name")
        # a Row's columns are its attributes, made at run time
        loaded = {str(row.name): int(row.n) for row in rows}  # pyright: ignore[reportAttributeAccessIssue]
    finally:
        tp.close()
    assert loaded == _slice_counts(json.loads(live_export.read_text())["traceEvents"])
    assert _summed(loaded) == _live_counts(live_log)
