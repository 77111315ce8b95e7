"""Tidy export: a report's and a sweep's rows (one per point x layer x metric), as CSV and Parquet, from the CLI."""

from __future__ import annotations

import csv
import importlib
import io
from pathlib import Path
from typing import Any

import pytest
from route_logs import NBYTES, write_log

from qnpipe import config
from qnpipe.cli import main
from qnpipe.replay import replay, sweep
from qnpipe.replay.export import ALL_LAYERS, LAYER_METRICS, config_columns, report_rows, to_csv


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_log(tmp_path_factory.mktemp("export") / "r.qtrace", layers=(0, 1, 3))


def _cfg(**over: object) -> config.Config:
    return config.load(None, env={}, overrides={"pool.expert_slots": 4, **over})


def _as_text(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(to_csv(rows).decode())))


def test_a_reports_rows_hold_every_layer_and_total_with_its_settings(log: Path) -> None:
    r = replay(log, _cfg(), record_nbytes=NBYTES, predictor="oracle")
    rows = r.rows(config_columns(_cfg()))
    assert rows == report_rows(r, config_columns(_cfg()))
    assert len({tuple(row) for row in rows}) == 1  # the same columns, in the same order, on every row
    assert list(rows[0])[:4] == ["pool.expert_slots", "pool.evict_policy", "pool.side_region_slots", "log"]
    assert list(rows[0])[-3:] == ["layer", "metric", "value"]
    assert rows[0]["pool.expert_slots"] == 4 and rows[0]["pool.evict_policy"] == "lfu"  # the default
    assert rows[0]["replay.predictor"] == "oracle" and rows[0]["device.queue_depth"] == r.device.queue_depth
    total = {row["metric"]: row["value"] for row in rows if row["layer"] == ALL_LAYERS}
    assert total["hit_rate"] == r.hit_rate and total["side_hit_rate"] == r.side_hit_rate
    assert r.prefetch is not None and total["prefetch.useful"] == r.prefetch.useful
    assert total["misses"] == sum(r.misses_by_cause.values())
    assert all(total[f"misses.{c}"] == n for c, n in r.misses_by_cause.items())
    per = [row for row in rows if row["layer"] != ALL_LAYERS]
    assert len(per) == len(r.layers) * (len(LAYER_METRICS) + 1)
    assert {row["layer"] for row in per} == {0, 1, 3}  # layer 2 is absent from the log: no rows
    for x in r.layers:
        got = {row["metric"]: row["value"] for row in per if row["layer"] == x.layer}
        assert got["hits"] == x.hits and got["belady_hit_rate"] == x.belady_hit_rate and got["slots"] == 4


def test_the_cli_writes_the_same_rows_as_csv(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.csv"
    assert main(["replay", str(log), "--set", "pool.expert_slots=4", "--set", "evict_policy=lru",
                 "--set", f"replay.record_nbytes={NBYTES}", "--csv", str(out)]) == 0
    capsys.readouterr()
    r = replay(log, _cfg(**{"pool.evict_policy": "lru"}), record_nbytes=NBYTES)
    expected = _as_text(r.rows(config_columns(_cfg(**{"pool.evict_policy": "lru"}))))
    got = list(csv.DictReader(io.StringIO(out.read_text())))
    assert got == expected and got[0]["pool.evict_policy"] == "lru"
    assert float(next(row["value"] for row in got if row["metric"] == "hit_rate")) == r.hit_rate  # full precision


def test_a_sweeps_csv_has_every_point_with_its_swept_values(log: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.csv"
    grid = ["pool.expert_slots=4,8", "replay.predictor=none,oracle"]
    assert main(["sweep", str(log), "--grid", *grid, "--set", f"replay.record_nbytes={NBYTES}",
                 "--set", "read.workers=2", "--executor", "serial", "--no-progress", "--csv", str(out)]) == 0
    capsys.readouterr()
    cfg = config.load(None, env={}, overrides={"read.workers": 2})
    result = sweep.run(log, sweep.plan(log, sweep.parse_grid(grid), cfg,
                                       fixed={"replay.record_nbytes": str(NBYTES)}), executor="serial")
    rows = result.rows(config_columns(cfg, ["read.workers"]))
    got = list(csv.DictReader(io.StringIO(out.read_text())))
    assert got == _as_text(rows)
    assert list(got[0])[:5] == ["point", "pool.expert_slots", "replay.predictor", "pool.evict_policy",
                                "pool.side_region_slots"]
    assert got[0]["read.workers"] == "2"
    by_point = {(row["point"], row["pool.expert_slots"], row["replay.predictor"]) for row in got}
    assert by_point == {("0", "4", "none"), ("1", "4", "oracle"), ("2", "8", "none"), ("3", "8", "oracle")}
    for p in result.points:
        assert p.report is not None
        hit = [row for row in got if row["point"] == str(p.index) and row["metric"] == "hit_rate"]
        assert [float(row["value"]) for row in hit if row["layer"] == "all"] == [p.report.hit_rate]


def test_parquet_holds_the_same_rows(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq = importlib.import_module("pyarrow.parquet")  # in the test extra: this test always runs
    out = tmp_path / "r.parquet"
    assert main(["replay", str(log), "--set", "pool.expert_slots=4", "--set", f"replay.record_nbytes={NBYTES}",
                 "--parquet", str(out)]) == 0
    capsys.readouterr()
    rows = replay(log, _cfg(), record_nbytes=NBYTES).rows(config_columns(_cfg()))
    table = pq.read_table(out)
    assert table.column_names == list(rows[0])
    assert table.to_pylist() == [{**row, "layer": str(row["layer"])} for row in rows]


def test_parquet_without_pyarrow_fails_before_the_replay_saying_how_to_install(
        log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.import_module

    def no_pyarrow(name: str, package: str | None = None) -> Any:
        if name.split(".")[0] == "pyarrow":
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_pyarrow)
    ran: list[int] = []
    for where in ("qnpipe.replay.replay", "qnpipe.replay.sweep.replay"):  # replay's and sweep's own
        monkeypatch.setattr(where, lambda *a, **k: ran.append(1))
    for cmd in (["replay", str(log)], ["sweep", str(log), "--grid", "pool.expert_slots=4,8", "--executor", "serial"]):
        assert main([*cmd, "--set", f"replay.record_nbytes={NBYTES}", "--parquet", str(tmp_path / "x.parquet")]) == 2
        assert "pip install 'qnpipe[parquet]'" in capsys.readouterr().err
    assert not ran and not (tmp_path / "x.parquet").exists()


def test_an_unwritable_csv_fails_before_the_replay_naming_it(log: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[int] = []
    for where in ("qnpipe.replay.replay", "qnpipe.replay.sweep.replay"):  # replay's and sweep's own
        monkeypatch.setattr(where, lambda *a, **k: ran.append(1))
    bad = tmp_path / "no-such-dir" / "r.csv"
    for cmd in (["replay", str(log)], ["sweep", str(log), "--grid", "pool.expert_slots=4,8", "--executor", "serial"]):
        assert main([*cmd, "--set", f"replay.record_nbytes={NBYTES}", "--csv", str(bad)]) == 2
        assert str(bad) in capsys.readouterr().err
    assert not ran
