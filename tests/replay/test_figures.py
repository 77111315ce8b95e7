"""Figures: the requested file format, readable by others, Belady on hit-rate plots, labels from the table, legends outside."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from route_logs import NBYTES, write_log

from qnpipe import config
from qnpipe.cli import main
from qnpipe.replay import replay, sweep
from qnpipe.replay.sweep_plot import LABELS, figure

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_log(tmp_path_factory.mktemp("figures") / "r.qtrace")


@pytest.fixture(scope="module")
def result(log: Path) -> sweep.SweepResult:
    points = sweep.plan(log, sweep.parse_grid(["pool.expert_slots=2,4,8", "pool.evict_policy=lru,lfu,fifo"]),
                        config.load(None, env={}), fixed={"replay.record_nbytes": str(NBYTES)})
    return sweep.run(log, points, executor="serial")


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _check_format(path: Path, fmt: str) -> None:
    data = path.read_bytes()
    if fmt == "svg":
        assert data.startswith(b"<?xml") and b"<svg" in data[:500] and data.rstrip().endswith(b"</svg>")
    else:
        assert data.startswith(MAGIC[fmt])
    if fmt == "png":
        from PIL import Image

        with Image.open(path) as im:
            im.verify()
    if fmt == "pdf":
        assert data.rstrip().endswith(b"%%EOF")


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("fmt", ["png", "pdf", "svg"])
def test_sweep_plots_have_the_requested_format_and_are_readable_by_others(log: Path, tmp_path: Path, fmt: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    assert main(["sweep", str(log), "--grid", "pool.expert_slots=2,4", "--set", f"replay.record_nbytes={NBYTES}",
                 "--executor", "serial", "--no-progress", "--metric", "hit_rate", "--plot-dir", str(out),
                 "--plot-format", fmt]) == 0
    capsys.readouterr()
    files = list(out.iterdir())
    assert [f.name for f in files] == [f"hit_rate-vs-pool.expert_slots.{fmt}"]
    _check_format(files[0], fmt)
    mode = stat.S_IMODE(files[0].stat().st_mode)
    assert mode & 0o044 == 0o044 and mode == 0o644  # group and others may read it: not mkstemp's 0600


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("fmt", ["pdf", "svg"])
def test_a_timeline_has_the_requested_format_and_is_readable_by_others(log: Path, tmp_path: Path, fmt: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events.qtrace"
    replay(log, config.load(None, env={}, overrides={"pool.expert_slots": 4, "trace.event_log_path": str(events)}),
           record_nbytes=NBYTES)
    by_flag, by_name = tmp_path / "t.plot", tmp_path / f"t.{fmt}"
    assert main(["trace", "plot", str(events), "-o", str(by_flag), "--plot-format", fmt]) == 0
    assert main(["trace", "plot", str(events), "-o", str(by_name)]) == 0  # the format from the suffix
    capsys.readouterr()
    for path in (by_flag, by_name):
        _check_format(path, fmt)
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044


def test_vector_plots_are_the_same_bytes_on_every_run(result: sweep.SweepResult, tmp_path: Path) -> None:
    from qnpipe.replay.sweep_plot import plot

    for fmt in ("pdf", "svg"):
        a = plot(result, "hit_rate", tmp_path / "a", fmt=fmt)
        b = plot(result, "hit_rate", tmp_path / "b", fmt=fmt)
        assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]  # no creation date inside


def test_a_hit_rate_plot_shows_belady_labels_from_the_table_and_its_legend_outside(result: sweep.SweepResult) -> None:
    fig = figure(result, "hit_rate", "pool.expert_slots")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "resident expert slots (per layer)"
    assert ax.get_ylabel() == "hit rate (fraction of expert requests)"
    belady = [line for line in ax.get_lines() if line.get_label().startswith("Belady")]
    assert len(belady) == 1  # the same for every policy: one line
    want = [p.metrics["belady_hit_rate"] for p in result.points if p.values["pool.evict_policy"] == "lru"]
    assert list(belady[0].get_xdata()) == [2, 4, 8] and list(belady[0].get_ydata()) == want
    series = [line for line in ax.get_lines() if not line.get_label().startswith("Belady")]
    assert [line.get_label() for line in series] == [f"eviction policy = {p}" for p in ("lru", "lfu", "fifo")]
    # overlapping series stay apart: each its own marker and line style
    assert len({line.get_marker() for line in series}) == 3 and len({line.get_linestyle() for line in series}) == 3
    assert ax.get_legend() is None and len(fig.legends) == 1  # the legend is the figure's, outside the axes
    assert "pool." not in ax.get_title()


def test_categorical_settings_are_grouped_points_not_joined_lines(result: sweep.SweepResult) -> None:
    fig = figure(result, "hit_rate", "pool.evict_policy")
    ax = fig.axes[0]
    points = [line for line in ax.get_lines() if line.get_label().startswith("resident expert slots")]
    assert len(points) == 3 and all(line.get_linestyle() == "None" for line in points)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lru", "lfu", "fifo"]
    # within a category each series has its own place, beside the others
    xs = [list(line.get_xdata()) for line in points]
    assert all(a[i] < b[i] for a, b in itertools.pairwise(xs) for i in range(3))
    assert all(abs(x - round(x)) < 0.5 for row in xs for x in row)
    assert ax.collections  # Belady: a bar across each point (hlines)


def test_a_plot_that_is_no_hit_rate_has_no_belady_and_converts_units(result: sweep.SweepResult) -> None:
    ax = figure(result, "stall_s_per_token", "pool.expert_slots").axes[0]
    assert not [line for line in ax.get_lines() if line.get_label().startswith("Belady")]
    assert ax.get_ylabel() == "stall (ms per step)"
    first = [line for line in ax.get_lines()][0]
    lru = [p.metrics["stall_s_per_token"] * 1e3 for p in result.points if p.values["pool.evict_policy"] == "lru"]
    assert list(first.get_ydata()) == pytest.approx(lru)
    assert LABELS["stall_s_per_token"][2] == 1e3


def test_no_two_series_share_colour_and_marker() -> None:
    from matplotlib.colors import to_hex

    points = [sweep.PointResult(index=i, values={"pool.expert_slots": s, "replay.predictor": pr},
                                metrics={"tok_s": float(i), "belady_hit_rate": 0.5}, report=None)
              for i, (s, pr) in enumerate((s, pr) for s in range(2, 26, 2) for pr in ("none", "oracle"))]
    result = sweep.SweepResult(log="x.qtrace", fields=["replay.predictor", "pool.expert_slots"], points=points)
    for field in result.fields:
        lines = figure(result, "tok_s", field).axes[0].get_lines()
        pairs = {(to_hex(line.get_color()), line.get_marker()) for line in lines}
        assert len(lines) in (12, 2) and len(pairs) == len(lines)
