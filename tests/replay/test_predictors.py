"""Replay predictors (recorded, previous, transition, oracle) and the report's prefetch fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import ConfigError
from qnpipe.messages import PrefetchHint
from qnpipe.replay import PredictorOpts, replay, to_json
from qnpipe.replay.synth import SynthSpec, write_synth

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}
PREFETCH = {"pool.expert_slots": "4", "predict.cross_layer_prefetch": "true", "pool.side_region_slots": "2",
            "predict.ahead_layers": "1", "predict.width_experts": "4"}
NBYTES = 1000


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The event log of a live prefetch run of a streamed tiny model."""
    import contextlib
    import io

    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("predict")
    hf = make_tiny(root / "hf", layout="hf", seed=5, config_overrides=SHAPE)
    convert(hf, root / "q")
    sets = [x for k, v in PREFETCH.items() for x in ("--set", f"{k}={v}")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", str(root / "q"), "--tokens", "5,6,7,8,9", "-n", "6", *sets,
                     "--trace", str(root / "live.qtrace")]) == 0
    return root / "live.qtrace"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Next layer = a fixed partner of this layer's experts: a transition table learns it exactly."""
    return write_synth(tmp_path_factory.mktemp("synth") / "s.qtrace",
                       SynthSpec(layers=4, experts=16, top_k=2, tokens=200, seed=1, cross_layer=1.0))


def _hints(path: Path) -> list[tuple[int, int, int, tuple[int, ...], tuple[float, ...]]]:
    _, records = trace.read(path)
    return [(r.step, r.source, r.layer, r.experts, r.scores) for r in records if isinstance(r, PrefetchHint)]


def _cfg(**over: str) -> config.Config:
    return config.load(None, overrides={"pool.expert_slots": "4", "pool.side_region_slots": "4", **over})


def test_recorded_candidates_replay_the_live_runs_hints(live: Path, tmp_path: Path) -> None:
    out = tmp_path / "replayed.qtrace"
    r = replay(live, config.load(None, overrides={**PREFETCH, "trace.event_log_path": str(out)}),
               predictor="recorded")
    want = _hints(live)
    assert want and _hints(out) == want  # the same Candidates through the same predictor actor
    assert r.prefetch is not None and r.prefetch.issued > 0


def test_recorded_candidates_give_one_report_and_log_from_both_drivers(live: Path, tmp_path: Path) -> None:
    got = []
    for driver in ("fast", "actors"):
        out = tmp_path / "replayed.qtrace"
        r = replay(live, config.load(None, overrides={**PREFETCH, "trace.event_log_path": str(out)}),
                   predictor="recorded", driver=driver)
        got.append((to_json(r), out.read_bytes()))
        out.unlink()
    assert got[0] == got[1]


def test_recorded_needs_candidates_in_the_log(synthetic: Path) -> None:
    with pytest.raises(ConfigError, match="no predict.candidates records"):
        replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="recorded")


def test_transition_learns_the_cross_layer_partners_from_the_first_part(synthetic: Path) -> None:
    opts = PredictorOpts(train_frac=0.2)
    r = replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="transition", opts=opts)
    assert r.train_steps == 40 and r.steps == 160 and r.predictor_opts == opts
    # layers 1..3 are predicted from the layer before: every acquired expert was hinted
    assert [x.prefetch_recall for x in r.layers[1:]] == [1.0, 1.0, 1.0] and r.layers[0].prefetch_recall == 0
    prev = replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="previous", opts=opts)
    none = replay(synthetic, _cfg(), record_nbytes=NBYTES, opts=opts)
    assert prev.prefetch is not None and r.prefetch is not None
    assert r.prefetch.recall > prev.prefetch.recall and r.hit_rate > none.hit_rate
    assert none.prefetch is None and none.side_hit_rate == 0 and none.steps == 160
    other = replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="transition",
                   opts=PredictorOpts(train_log=str(synthetic)))
    assert other.train_steps == 0 and [x.prefetch_recall for x in other.layers[1:]] == [1.0, 1.0, 1.0]


def test_transition_needs_something_to_learn_from(synthetic: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--train-frac"):
        replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="transition")
    wide = write_synth(tmp_path / "w.qtrace", SynthSpec(layers=4, experts=32, top_k=2, tokens=5))
    with pytest.raises(ConfigError, match="is not the log's"):
        replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="transition",
               opts=PredictorOpts(train_log=str(wide)))
    with pytest.raises(ConfigError, match=r"train_frac=1.0"):
        replay(synthetic, _cfg(), record_nbytes=NBYTES, opts=PredictorOpts(train_frac=1.0))
    with pytest.raises(ConfigError, match="recall=2"):
        replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="oracle", opts=PredictorOpts(recall=2))


def test_oracle_recall_is_what_was_asked_and_seeded(synthetic: Path) -> None:
    full = replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="oracle")
    assert [x.prefetch_recall for x in full.layers[1:]] == [1.0, 1.0, 1.0]
    half = [replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor="oracle",
                   opts=PredictorOpts(recall=0.5, seed=s)) for s in (1, 1, 2)]
    assert to_json(half[0]) == to_json(half[1]) and to_json(half[0]) != to_json(half[2])
    for x in half[0].layers[1:]:
        assert 0.4 < x.prefetch_recall < 0.6
    assert full.hit_rate > half[0].hit_rate


@pytest.mark.parametrize("predictor", ["previous", "transition", "oracle"])
def test_prefetch_report_adds_up(synthetic: Path, predictor: str) -> None:
    r = replay(synthetic, _cfg(), record_nbytes=NBYTES, predictor=predictor,
               opts=PredictorOpts(train_frac=0.1, recall=0.7))
    p = r.prefetch
    assert p is not None and p.reads > 0
    assert p.useful + p.wasted == p.reads and p.useful_bytes == p.useful * NBYTES
    assert p.wasted_bytes == p.wasted * NBYTES and p.issued >= p.reads
    assert p.precision == p.useful / p.reads
    requests = sum(x.requests for x in r.layers)
    assert sum(x.side_hits for x in r.layers) == round(r.side_hit_rate * requests)
    assert r.resident_hit_rate + r.side_hit_rate == pytest.approx(r.hit_rate)


def test_cli_knows_every_predictor_and_starts_without_mlx() -> None:
    import subprocess
    import sys

    from qnpipe.cli import replay_cmd
    from qnpipe.replay import DRIVERS, PREDICTORS

    assert replay_cmd.PREDICTORS == PREDICTORS
    assert replay_cmd.DRIVERS == DRIVERS
    code = "import sys; from qnpipe.cli import build_parser; build_parser(); print('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_cli_replay_predictors_print_the_whole_report(synthetic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["replay", str(synthetic), "--set", f"replay.record_nbytes={NBYTES}", "--set", "pool.expert_slots=4"]
    assert main([*base, "--predict", "oracle", "--recall", "0.5", "--seed", "3", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["predictor"] == "oracle" and rep["predictor_opts"]["recall"] == 0.5
    assert set(rep["prefetch"]) >= {"recall", "useful", "wasted", "useful_bytes", "wasted_bytes"}
    assert {"resident_hit_rate", "side_hit_rate"} <= set(rep) and "side_hits" in rep["layers"][0]
    assert main([*base, "--predict", "transition", "--train-frac", "0.25"]) == 0
    assert "prefetch (transition): recall" in capsys.readouterr().out
    assert main([*base, "--predict", "transition"]) == 2
    assert "--train-frac" in capsys.readouterr().err
