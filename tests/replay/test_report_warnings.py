"""Warnings beside misleading numbers: absent layers left out and counted, clamped capacities and budgets below top-k said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from route_logs import NBYTES, write_log

from qnpipe import config
from qnpipe.cli import main
from qnpipe.replay import PredictorOpts, describe, replay, to_json
from qnpipe.replay.caveats import spans


def _cfg(**over: object) -> config.Config:
    return config.load(None, env={}, overrides={"pool.expert_slots": 4, **over})


def test_layers_the_log_never_routes_through_are_left_out_and_counted(tmp_path: Path) -> None:
    full = replay(write_log(tmp_path / "full.qtrace"), _cfg(), record_nbytes=NBYTES)
    assert full.warnings == [] and full.absent_layers == []
    r = replay(write_log(tmp_path / "one.qtrace", layers=(1,)), _cfg(), record_nbytes=NBYTES)
    assert [x.layer for x in r.layers] == [1] and r.absent_layers == [0, 2, 3]
    assert r.warnings == ["3 of 4 MoE layers have no route in the log (layers 0, 2-3): they are left out of the "
                          "per-layer table and of every total, not counted as 0 hits; memory_bytes and steps/s "
                          "(tok_s) are those of the log's 1 layer alone (their slots, their compute and reads), "
                          "not the whole model's"]
    # the totals are layer 1's alone, not diluted by three empty layers
    assert r.hit_rate == r.layers[0].hit_rate > 0
    # ... the memory too: layer 1's slots, not four layers'
    assert r.slots == {1: 4} and r.memory_bytes == 4 * NBYTES == full.memory_bytes // 4
    text = describe(r)
    table = text.split("belady\n")[1].splitlines()
    assert len(table) == 2 and table[0].split()[0] == "1" and "not shown: layers 0, 2-3" in table[1]
    assert "WARNING: 3 of 4 MoE layers" in text
    assert json.loads(to_json(r))["warnings"] == r.warnings


def test_a_capacity_above_the_expert_count_says_it_was_clamped(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace")
    r = replay(log, _cfg(**{"pool.expert_slots": 40}), record_nbytes=NBYTES)
    assert set(r.capacities.values()) == {16}
    assert len(r.warnings) == 1 and r.warnings[0].startswith("pool.expert_slots=40 is above the model's 16 experts")
    assert "clamped to 16" in r.warnings[0]
    profile = tmp_path / "caps.json"
    profile.write_text(json.dumps({"layer_caps": {"0": 4, "1": 17, "2": 99, "3": 16}}))
    r = replay(log, _cfg(**{"pool.capacity_profile_path": str(profile)}), record_nbytes=NBYTES)
    assert r.capacities == {0: 4, 1: 16, 2: 16, 3: 16}
    assert len(r.warnings) == 1 and f"capacity_profile_path={profile} (layers 1-2)" in r.warnings[0]
    assert replay(log, _cfg(**{"pool.expert_slots": 16}), record_nbytes=NBYTES).warnings == []


@pytest.mark.parametrize(("key", "value"), [("predict.per_layer_budget_experts", 1),
                                            ("predict.file_global_budget_experts", 1),
                                            ("pool.side_region_slots", 1)])
def test_a_prefetch_budget_below_top_k_says_so_when_prefetch_is_on(tmp_path: Path, key: str, value: int) -> None:
    log = write_log(tmp_path / "r.qtrace")
    on = replay(log, _cfg(**{key: value}), record_nbytes=NBYTES, predictor="oracle")
    assert len(on.warnings) == 1 and on.warnings[0].startswith(f"{key}={value} is below the model's top-k (2)")
    assert replay(log, _cfg(**{key: value}), record_nbytes=NBYTES).warnings == []  # demand only: no prefetch to cap
    assert replay(log, _cfg(), record_nbytes=NBYTES, predictor="oracle").warnings == []  # the defaults: no warning


def test_the_text_report_puts_prefetched_hits_apart_from_resident_ones(tmp_path: Path) -> None:
    r = replay(write_log(tmp_path / "r.qtrace"), _cfg(), record_nbytes=NBYTES, predictor="oracle")
    assert r.side_hit_rate > 0
    text = describe(r)
    assert (f"hit rate {r.hit_rate:.3f} = resident {r.resident_hit_rate:.3f} + prefetched in time "
            f"{r.side_hit_rate:.3f}") in text.splitlines()[1]
    header, *rows = text.split("  layer")[1].splitlines()
    assert header.split()[3:5] == ["resident", "in"]
    for x, row in zip(r.layers, rows, strict=True):
        assert [int(c) for c in row.split()[2:6]] == [x.requests, x.hits, x.hits - x.side_hits, x.side_hits]
    demand = describe(replay(tmp_path / "r.qtrace", _cfg(), record_nbytes=NBYTES))
    assert "prefetched" not in demand and "resident" not in demand.split("  layer")[1]


def test_the_cli_prints_warnings_in_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "one.qtrace", layers=(0, 3))
    args = ["replay", str(log), "--set", "pool.expert_slots=32", "--set", f"replay.record_nbytes={NBYTES}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("WARNING:") == 2 and "layers 1-2" in out and "pool.expert_slots=32" in out
    assert main([*args, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["absent_layers"] == [1, 2] and len(rep["warnings"]) == 2 and [x["layer"] for x in rep["layers"]] == [0, 3]


def test_spans_write_runs_of_layers() -> None:
    assert spans([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    assert spans([]) == "" and spans([3]) == "3"


def test_a_prediction_width_above_the_expert_count_is_clamped_and_said(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace", steps=40)
    over = {"predict.width_experts": 40, "pool.side_region_slots": 4}
    r = replay(log, _cfg(**over), record_nbytes=NBYTES, predictor="transition",
               opts=PredictorOpts(train_frac=0.5))
    at = replay(log, _cfg(**{**over, "predict.width_experts": 16}), record_nbytes=NBYTES, predictor="transition",
                opts=PredictorOpts(train_frac=0.5))
    assert any(w.startswith("predict.width_experts=40 is above the model's 16 experts: clamped to 16")
               for w in r.warnings)
    assert not any("width_experts" in w for w in at.warnings)
    assert (r.hit_rate, r.prefetch) == (at.hit_rate, at.prefetch)  # the clamped run is the run at 16
