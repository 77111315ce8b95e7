"""`qnpipe generate --mtp [-K N]`, the stats it reports, the event log, and a model without MTP weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

import qnpipe
from qnpipe import trace
from qnpipe.cli import main
from qnpipe.convert.tiny import make_tiny


def test_generate_mtp_json_stats_and_event_log(trained_hf: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.qtrace"
    args = ["generate", str(trained_hf), "-p", "def add(a, b):", "-n", "24", "--json", "--set", "mtp.hidden=post_norm"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["stats"]["mtp"] is None
    assert main([*args, "--mtp", "-K", "2", "--trace", str(log), "--set", "diag.accept_topk=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain["tokens"]
    m = out["stats"]["mtp"]
    assert len(m["accept_hist"]) == 3 and sum(m["accept_hist"]) == m["rounds"] > 0
    assert m["mean_accept_len"] == pytest.approx(m["tokens"] / m["rounds"])
    assert len(m["accept_rate_at"]) == 2 and len(m["topk_hits"]) == 2
    assert m["topk_hits"][0] >= m["accepted_at"][0]  # an accepted draft is the drafter's top-1
    assert out["engine"]["mtp"]["rounds"] == m["rounds"]
    _, recs = trace.read(log)
    rounds = [r for r in recs if isinstance(r, trace.SpecRound)]
    assert len(rounds) == m["rounds"]
    assert [r.accepted for r in rounds].count(2) == m["accept_hist"][2]


def test_generate_mtp_prints_its_stats_line(trained_hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(trained_hf), "-p", "def add(a, b):", "-n", "12", "--mtp", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "[mtp: " in err and "tokens per round" in err and "acceptance by position" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", str(trained_hf), "-p", "x", "--mtp", "-K", "0"])
    assert e.value.code == 2
    assert "-K/--num-draft-tokens" in capsys.readouterr().err


def test_a_model_without_mtp_weights_runs_without_and_says_so_once(tmp_path: Path) -> None:
    d = make_tiny(tmp_path / "mlx", layout="mlx")  # mlx-lm layout: no mtp.*
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with qnpipe.Engine(d, mtp=True) as eng:
            a = eng.generate([5, 6, 7], max_tokens=6, stop_at_eos=False)
            b = eng.generate([5, 6, 7], max_tokens=6, stop_at_eos=False)
    said = [w for w in caught if "no MTP weights" in str(w.message)]
    assert len(said) == 1 and str(d) in str(said[0].message)
    assert a.tokens == b.tokens and a.stats.mtp is None and eng.stats().mtp is None


def test_mtp_fields_reach_the_loop_from_every_config_source(tmp_path: Path) -> None:
    from qnpipe import config
    from qnpipe.config import MtpHidden, MtpVerifyMode
    from qnpipe.live.mtp.engine import options
    from qnpipe.live.mtp.tree import Branch

    toml = tmp_path / "q.toml"
    toml.write_text('[mtp]\nenabled = true\nnum_draft_tokens = 4\nhidden = "post_norm"\n')
    o = options(config.load(toml, env={}))
    assert (o.k, o.hidden, o.branches) == (4, MtpHidden.POST_NORM, ())
    env = {"MTP_VERIFY_MODE": "sequential", "MTP_ADAPTIVE_DEPTH": "1", "MTP_CONF_TAU": "0.5", "MTP_DEPTH_MAX": "5",
           "MTP_ADAPTIVE_RESCUE": "1", "QNPIPE_DIAG__ACCEPT_TOPK": "3"}
    o = options(config.load(toml, env=env))
    assert (o.k, o.verify_mode, o.adaptive_depth, o.conf_tau, o.max_depth, o.accept_topk) == (
        4, MtpVerifyMode.SEQUENTIAL, True, 0.5, 5, 3)
    assert o.branches == (Branch(0, 1),)
    o = options(config.load(toml, env={"TREE_VERIFY": "1"}, overrides={"mtp.tree_branches": 4}),
                temperature=0.7, seed=5)
    assert o.branches == (Branch(0, 1), Branch(0, 2), Branch(0, 3)) and o.sampling and o.seed == 5
    o = options(config.load(env={}, overrides={"mtp.tree_top2": True, "mtp.tree_top2_p1": True}))
    assert o.branches == (Branch(0, 1), Branch(1, 1))


def test_mtp_weights_path_gives_a_model_without_mtp_its_head(tiny_hf: Path, tmp_path: Path) -> None:
    from qnpipe.errors import ConfigError

    d = make_tiny(tmp_path / "mlx", layout="mlx")  # the same random model as tiny_hf, without mtp.*
    with qnpipe.Engine(d) as eng:
        plain = eng.generate([5, 6, 7], max_tokens=16, stop_at_eos=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no MTP weights" warning now
        over: dict[str, Any] = {"model.mtp_weights_path": str(tiny_hf / "model.safetensors")}
        with qnpipe.Engine(d, mtp=True, **over) as eng:
            res = eng.generate([5, 6, 7], max_tokens=16, stop_at_eos=False)
    assert res.tokens == plain.tokens and res.stats.mtp is not None and res.stats.mtp.rounds > 0
    with pytest.raises(ConfigError, match="model.mtp_weights_path=.*missing.safetensors"):
        qnpipe.Engine(d, mtp=True, **{"model.mtp_weights_path": str(tmp_path / "missing.safetensors")})  # pyright: ignore[reportArgumentType]
