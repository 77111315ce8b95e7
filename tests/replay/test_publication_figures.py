"""Every figure kind (sweep, miss-ratio curves, timeline, plan) as a journal would print it: PNG, PDF and SVG
with the right magic bytes and their axis text readable in the file (SVG text elements, PDF text with a
ToUnicode map), a provenance line, no text outside the canvas and none colliding (matplotlib's own extents)."""

from __future__ import annotations

import html
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from route_logs import NBYTES, write_log

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.io.figure import DPI, FigureOptions, outside_canvas
from qnpipe.replay import miss_ratio_curves, replay, sweep
from qnpipe.replay.mrc import ALL, Curve, MrcResult
from qnpipe.replay.sweep_plot import NOT_MONOTONE, figure

FORMATS = ("png", "pdf", "svg")
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<?xml"}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_log(tmp_path_factory.mktemp("pub") / "r.qtrace")


@pytest.fixture(scope="module")
def result(log: Path) -> sweep.SweepResult:
    grid = ["pool.expert_slots=2,4,8", "pool.evict_policy=lru,lfu,fifo"]
    points = sweep.plan(log, sweep.parse_grid(grid), config.load(None, env={}),
                        fixed={"replay.record_nbytes": str(NBYTES)})
    return sweep.run(log, points, executor="serial")


@pytest.fixture(scope="module")
def categorical(log: Path) -> sweep.SweepResult:
    """The sweep of the issue: a categorical setting (pool.prefetch_into) beside two others."""
    grid = ["pool.prefetch_into=side,main", "pool.side_region_slots=2,4", "replay.predictor=previous,none"]
    points = sweep.plan(log, sweep.parse_grid(grid), config.load(None, env={}),
                        fixed={"replay.record_nbytes": str(NBYTES)})
    return sweep.run(log, points, executor="serial")


@pytest.fixture(scope="module")
def events(log: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pub-events") / "events.qtrace"
    replay(log, config.load(None, env={}, overrides={"pool.expert_slots": 4, "trace.event_log_path": str(path)}),
           record_nbytes=NBYTES)
    return path


def _pdf_texts(data: bytes) -> list[str]:
    """The text of each text object of a PDF matplotlib wrote (embedded TrueType fonts, two-byte codes,
    each font's ToUnicode map from its codes to text): what a reader's search or copy gets."""
    assert b"/FontFile2" in data  # embedded TrueType, not Type 3 outlines
    objs = {int(n): body for n, body in re.findall(rb"(?s)(\d+) 0 obj\s*(.*?)endobj", data)}

    def stream(body: bytes) -> bytes:
        raw = re.search(rb"(?s)stream\r?\n(.*?)\r?\nendstream", body)
        assert raw is not None
        return zlib.decompress(raw.group(1)) if b"/FlateDecode" in body else raw.group(1)

    def utf16(h: bytes) -> str:
        return bytes.fromhex(h.decode()).decode("utf-16-be")

    maps: dict[bytes, dict[int, str]] = {}
    for res in [data]:  # the page's font resources: /F1 15 0 R ...
        for name, ref in re.findall(rb"/(F\d+)\s+(\d+) 0 R", res):
            uni = re.search(rb"/ToUnicode (\d+) 0 R", objs[int(ref)])
            assert uni is not None, f"font {name!r} has no ToUnicode map: its text cannot be read back"
            table: dict[int, str] = {}
            for lo, hi, dst in re.findall(rb"<([0-9a-f]+)> <([0-9a-f]+)> (\[[^\]]*\]|<[0-9a-f]+>)",
                                          stream(objs[int(uni.group(1))]), re.I):
                targets = re.findall(rb"<([0-9a-f]+)>", dst, re.I)
                for i, code in enumerate(range(int(lo, 16), int(hi, 16) + 1)):
                    table[code] = utf16(targets[i]) if dst.startswith(b"[") else chr(ord(utf16(targets[0])) + i)
            maps[name] = table
    out = []
    for body in objs.values():
        if b"stream" not in body or b"BT" not in (content := stream(body)):
            continue
        for block in re.findall(rb"(?s)\nBT\n(.*?)\nET\n", content):
            fonts = [(m.start(), m.group(1)) for m in re.finditer(rb"/(F\d+) [\d.]+ Tf", block)]
            text = ""
            for pos, raw in _strings(block):
                table = maps[max((f for f in fonts if f[0] < pos), default=fonts[0])[1]]
                raw = _literal(raw)
                text += "".join(table.get(int.from_bytes(raw[i:i + 2], "big"), "?") for i in range(0, len(raw), 2))
            out.append(text)
    return out


def _strings(block: bytes) -> list[tuple[int, bytes]]:
    """The literal strings `( ... )` of a content stream block, with where each starts, escapes left in."""
    out, i = [], 0
    while (i := block.find(b"(", i)) >= 0:
        depth, j = 1, i + 1
        while depth:
            c = block[j:j + 1]
            if c == b"\\":
                j += 1
            elif c == b"(":
                depth += 1
            elif c == b")":
                depth -= 1
            j += 1
        out.append((i, block[i + 1:j - 1]))
        i = j
    return out


def _literal(s: bytes) -> bytes:
    escapes = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"f": b"\f"}
    return re.sub(rb"\\([0-7]{1,3}|.)", lambda m: bytes([int(m.group(1), 8)]) if m.group(1).isdigit()
                  else escapes.get(m.group(1), m.group(1)), s, flags=re.S)


def _file_text(path: Path, fmt: str) -> str:
    data = path.read_bytes()
    assert data.startswith(MAGIC[fmt])
    if fmt == "svg":
        assert b"<svg" in data[:600] and data.rstrip().endswith(b"</svg>")
        return html.unescape(" ".join(re.findall(r"<text[^>]*>(.*?)</text>", data.decode(), re.S)))
    if fmt == "pdf":
        assert data.rstrip().endswith(b"%%EOF")
        return " ".join(_pdf_texts(data))
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    return ""


def _figures(result: sweep.SweepResult, categorical: sweep.SweepResult, log: Path, events: Path,
             tmp: Path) -> dict[str, tuple[Callable[[Path], Any], list[str]]]:
    """Each figure kind: how to write it to a path, and the axis text it must hold."""
    from qnpipe.replay.mrc_export import plot as mrc_plot
    from qnpipe.replay.sweep_plot import plot as sweep_plot
    from qnpipe.trace.plot import draw
    from qnpipe.trace.timeline import timeline

    def one_sweep(res: sweep.SweepResult, metric: str, field: str) -> Callable[[Path], Any]:
        def write(path: Path) -> None:
            (written,) = [p for p in sweep_plot(res, metric, tmp / path.stem, fmt=path.suffix[1:]) if field in p.name]
            written.replace(path)
        return write

    curves = miss_ratio_curves(log)
    header, records = trace.read(events)
    tl = timeline(header, records, (None, None))
    return {
        "sweep": (one_sweep(result, "hit_rate", "pool.expert_slots"),
                  ["resident expert slots (per layer)", "hit rate (fraction of expert requests)"]),
        "by-policy": (one_sweep(result, "hit_rate", "pool.evict_policy"), ["eviction policy", "lfu", "fifo"]),
        "categorical": (one_sweep(categorical, "tok_s", "pool.prefetch_into"),
                        ["prefetch placement", "throughput (steps / virtual s)", "main"]),
        "mrc": (lambda p: mrc_plot(curves, p, layers=[0]),
                ["capacity (expert slots per layer)", "miss ratio (fraction of expert requests read)"]),
        "timeline": (lambda p: draw(tl, p, fmt=p.suffix[1:]), ["ms from the start of step", "lane 0", "compute"]),
    }


@pytest.mark.parametrize("kind", ["sweep", "by-policy", "categorical", "mrc", "timeline"])
def test_every_figure_kind_in_every_format_has_its_magic_and_readable_axis_text(
        kind: str, result: sweep.SweepResult, categorical: sweep.SweepResult, log: Path, events: Path,
        tmp_path: Path) -> None:
    write, texts = _figures(result, categorical, log, events, tmp_path)[kind]
    for fmt in FORMATS:
        path = tmp_path / f"{kind}.{fmt}"
        write(path)
        found = _file_text(path, fmt)
        if fmt == "png":
            from PIL import Image

            with Image.open(path) as im:
                assert im.info["dpi"][0] == pytest.approx(DPI, abs=1) and im.size[0] >= 6 * DPI
            continue
        flat = " ".join(found.split())  # wrapped labels: their lines joined
        for want in [*texts, "qnpipe "]:
            assert want in flat, f"{kind}.{fmt}: {want!r} is not text in the file"


def test_the_plan_plot_marks_the_budget_in_every_format(tiny_qn4: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.plan import load_plan
    from qnpipe.plan.plot import plot_plans

    out, svg = tmp_path / "plan.json", tmp_path / "plan.svg"
    assert main(["plan", str(tiny_qn4), "--memory", "2GB", "--context", "512", "-o", str(out), "--plot", str(svg),
                 "--window-layer-steps", "400", "--title", "my plan"]) == 0
    capsys.readouterr()
    plan = load_plan(out)
    for fmt in ("png", "pdf"):
        plot_plans([plan], plan, tmp_path / f"plan.{fmt}")
    for fmt in FORMATS:
        flat = " ".join(_file_text(tmp_path / f"plan.{fmt}", fmt).split())
        if fmt != "png":
            assert "memory budget (GiB)" in flat and "requested budget" in flat and plan.device_name in flat
            assert "cost model" in flat and "qnpipe " in flat
    assert "my plan" in _file_text(svg, "svg")


def _overlaps(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize(("which", "metric", "field"), [("categorical", "tok_s", "pool.prefetch_into"),
                                                       ("categorical", "hit_rate", "pool.side_region_slots"),
                                                       ("result", "hit_rate", "pool.evict_policy")])
def test_a_categorical_and_a_by_policy_figure_keep_every_text_on_the_canvas_and_apart(
        which: str, metric: str, field: str, result: sweep.SweepResult, categorical: sweep.SweepResult) -> None:
    fig = figure(categorical if which == "categorical" else result, metric, field)
    assert outside_canvas(fig) == []
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = {"title": ax.title, "xlabel": ax.xaxis.label, "ylabel": ax.yaxis.label, "provenance": fig._supxlabel,
             "legend": fig.legends[0]}
    extents = {k: v.get_window_extent(renderer) for k, v in boxes.items()}
    for a in extents:
        for b in extents:
            if a < b:
                assert not _overlaps(extents[a], extents[b]), f"{a} collides with {b}"
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert not any(_overlaps(p, q) for i, p in enumerate(ticks) for q in ticks[i + 1:])
    assert all(t.get_fontsize() >= 6 for t in fig.findobj(lambda a: hasattr(a, "get_fontsize")))


def test_the_canvas_check_finds_a_made_up_stray_text() -> None:
    fig = figure(sweep.SweepResult(log="x.qtrace", fields=["pool.expert_slots"], points=[sweep.PointResult(
        index=0, values={"pool.expert_slots": 2}, metrics={"tok_s": 1.0}, report=None)]), "tok_s", "pool.expert_slots")
    fig.text(0.95, 0.5, "a label running off the figure")
    assert outside_canvas(fig) == ["a label running off the figure"]


def _belady_midpoints(ax: Any) -> list[tuple[float, float]]:
    return [((x0 + x1) / 2, y) for bars in ax.collections for (x0, y), (x1, _) in bars.get_segments()]


def test_belady_sits_on_its_points_in_the_by_policy_plot(result: sweep.SweepResult,
                                                         categorical: sweep.SweepResult) -> None:
    # each series its own Belady (it depends on the slots the series hold): a bar centred on each of its points
    ax = figure(result, "hit_rate", "pool.evict_policy").axes[0]
    mids = _belady_midpoints(ax)
    series = [line for line in ax.get_lines() if line.get_label().startswith("resident")]
    assert len(mids) == sum(len(line.get_xdata()) for line in series) == 9
    for line in series:
        assert all(any(m[0] == pytest.approx(x) for m in mids) for x in line.get_xdata())
    # one Belady for every series (the same resident slots): one bar across the category, centred on its tick
    ax = figure(categorical, "hit_rate", "pool.prefetch_into").axes[0]
    assert [m[0] for m in _belady_midpoints(ax)] == pytest.approx([0.0, 1.0])


def test_y_axes_start_at_zero_and_are_not_fixed_to_one(categorical: sweep.SweepResult,
                                                         result: sweep.SweepResult) -> None:
    tok = figure(categorical, "tok_s", "pool.prefetch_into").axes[0]
    assert tok.get_ylim()[0] == 0.0  # a 1 % spread is not drawn as a cliff
    hit = figure(result, "hit_rate", "pool.expert_slots").axes[0]
    top = max(p.metrics["hit_rate"] for p in result.points)
    assert hit.get_ylim()[0] == 0.0 and hit.get_ylim()[1] <= max(1.02, top * 1.1)


def test_options_set_title_labels_size_and_dpi(result: sweep.SweepResult, tmp_path: Path) -> None:
    from qnpipe.replay.sweep_plot import plot

    opts = FigureOptions(title="T", xlabel="X", ylabel="Y", size=(3.5, 2.6), dpi=300)
    fig = figure(result, "hit_rate", "pool.expert_slots", opts)
    ax = fig.axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("T", "X", "Y")
    assert tuple(fig.get_size_inches()) == (3.5, 2.6)
    (png,) = plot(sweep.SweepResult(log=result.log, fields=["pool.expert_slots"], points=result.points), "hit_rate",
                  tmp_path, opts=opts)
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (1050, 780)


def test_the_mrc_plot_draws_the_miss_ratio_and_says_when_belady_is_not_monotone(log: Path, tmp_path: Path) -> None:
    from qnpipe.replay.mrc_export import not_monotone, plot

    curves = miss_ratio_curves(log)
    svg = plot(curves, tmp_path / "m.svg")
    text = _file_text(svg, "svg")
    assert "miss-ratio curves" in text and "miss ratio" in text and "not monotone" not in text
    # a made-up log where more slots lose hits (the held-together Belady of a batched log can)
    falling = MrcResult(log="b.qtrace", shape=curves.shape, min_capacity=2, curves=[
        Curve(policy="belady", layer=ALL, capacities=[2, 3, 4], hits=[5, 4, 9], requests=[10, 10, 10]),
        Curve(policy="lru", layer=ALL, capacities=[2, 3, 4], hits=[3, 4, 5], requests=[10, 10, 10])])
    assert not_monotone(falling) and not not_monotone(curves)
    text = " ".join(_file_text(plot(falling, tmp_path / "f.svg"), "svg").split())
    assert "not monotone" in text and "not optimal" in text
    lru = next(line for line in _mrc_axes(falling).get_lines() if line.get_label().startswith("LRU"))
    assert list(lru.get_ydata()) == pytest.approx([0.7, 0.6, 0.5])  # 1 - hit rate


def _mrc_axes(res: MrcResult) -> Any:
    from qnpipe.replay.mrc_export import plot

    return _drawn(lambda p: plot(res, p)).axes[0]


def test_sweep_notes_a_falling_belady() -> None:
    points = [sweep.PointResult(index=i, values={"pool.expert_slots": s}, metrics={"hit_rate": 0.5, BELADY: b},
                                report=None) for i, (s, b) in enumerate([(2, 0.6), (4, 0.55), (8, 0.8)])]
    ax = figure(sweep.SweepResult(log="x.qtrace", fields=["pool.expert_slots"], points=points), "hit_rate",
                "pool.expert_slots").axes[0]
    assert any("not optimal" in " ".join(line.get_label().split()) for line in ax.get_lines())
    assert NOT_MONOTONE.startswith("Belady falls")


BELADY = "belady_hit_rate"


def test_replay_mrc_writes_no_plot_unless_asked(log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["replay", str(log), "--mrc"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["r.mrc.csv"]
    assert main(["replay", str(log), "--mrc", "--csv", "c.csv", "--plot", "c.pdf", "--size", "3.5x2.5"]) == 0
    capsys.readouterr()
    assert (tmp_path / "c.pdf").read_bytes().startswith(b"%PDF-")  # the format its name asks for, not PNG bytes
    assert main(["replay", str(log), "--mrc", "--plot", "d.png", "--size", "huge"]) == 2
    assert "--size huge" in capsys.readouterr().err and not (tmp_path / "d.png").exists()


def _drawn(write: Callable[[Path], Any]) -> Any:
    """The matplotlib figure `write` saves."""
    import tempfile

    import matplotlib.figure

    captured: list[Any] = []
    real = matplotlib.figure.Figure.savefig

    def keep(self: Any, *a: Any, **k: Any) -> None:
        captured.append(self)
        real(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        mp.setattr(matplotlib.figure.Figure, "savefig", keep)
        write(Path(d) / "x.png")
    return captured[0]


@pytest.mark.parametrize("kind", ["mrc", "timeline"])
def test_the_mrc_and_timeline_figures_keep_every_text_on_the_canvas(
        kind: str, result: sweep.SweepResult, categorical: sweep.SweepResult, log: Path, events: Path,
        tmp_path: Path) -> None:
    fig = _drawn(_figures(result, categorical, log, events, tmp_path)[kind][0])
    assert outside_canvas(fig) == []
    renderer = fig.canvas.get_renderer()
    legend = (fig.legends or [fig.axes[0].get_legend()])[0].get_window_extent(renderer)
    assert not _overlaps(fig._supxlabel.get_window_extent(renderer), legend)  # the provenance line
