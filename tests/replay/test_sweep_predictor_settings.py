"""A sweep sets the predictor's options (replay.train_frac, replay.recall, replay.seed) and replay.step_order as
settings: a trained predictor can be swept at equal memory, and each point's report is the replay's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from route_logs import NBYTES, write_log

from qnpipe import config
from qnpipe.cli import main
from qnpipe.errors import ConfigError
from qnpipe.replay import PredictorOpts, replay
from qnpipe.replay.sweep import parse_grid, plan, run


def _cfg() -> config.Config:
    return config.load(None, env={}, overrides={"pool.expert_slots": 4, "pool.side_region_slots": 2})


def test_train_frac_recall_seed_and_step_order_are_grid_fields(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace", steps=40)
    axes = parse_grid(["replay.predictor=transition,oracle", "replay.train_frac=0.25,0.5", "replay.recall=0.5",
                       "replay.seed=3", "replay.step_order=id,router"])
    points = plan(log, axes, _cfg(), fixed={"replay.record_nbytes": str(NBYTES)}, equal_memory=True)
    assert len(points) == 8
    assert {p.opts for p in points} == {PredictorOpts(train_frac=f, recall=0.5, seed=3) for f in (0.25, 0.5)}
    result = run(log, points, executor="serial")
    assert not result.failed
    for p, got in zip(points, result.points, strict=True):
        assert got.report is not None
        assert got.report.predictor_opts == p.opts and got.report.step_order == p.step_order
        assert got.report.train_steps == int(40 * p.opts.train_frac)
        want = replay(log, p.cfg, record_nbytes=NBYTES, predictor=p.predictor, opts=p.opts, step_order=p.step_order)
        assert got.report.hit_rate == want.hit_rate


@pytest.mark.parametrize(("item", "match"), [("replay.train_frac=1.5", "replay.train_frac=1.5: must be in"),
                                             ("replay.recall=2", "replay.recall=2.0: must be in"),
                                             ("replay.seed=-1", "replay.seed=-1: must be"),
                                             ("replay.step_order=random", "replay.step_order='random'")])
def test_a_bad_predictor_setting_names_the_point_and_the_setting(tmp_path: Path, item: str, match: str) -> None:
    log = write_log(tmp_path / "r.qtrace")
    with pytest.raises(ConfigError, match=match):
        plan(log, parse_grid([item]), _cfg(), fixed={"replay.record_nbytes": str(NBYTES)})


def test_the_sweep_command_takes_train_frac(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "r.qtrace", steps=30)
    assert main(["sweep", str(log), "--executor", "serial", "--no-progress", "--predict", "transition",
                 "--train-frac", "0.3", "--set", f"replay.record_nbytes={NBYTES}", "--set", "expert_slots=4",
                 "--set", "side_region_slots=2", "--grid", "replay.seed=0,1", "--json"]) == 0
    assert '"train_frac":0.3' in capsys.readouterr().out.replace(" ", "")
