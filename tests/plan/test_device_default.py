"""The planner's default device is this machine's measured profile, measured once and kept in the user cache
directory (qnpipe.config.user_dirs); `qnpipe bench io` saves there; `qnpipe plan` reads the log `--memory` reads
and says which profile and cost model its prediction used. Measurements here are fakes or a few MiB."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.cli import main
from qnpipe.config.user_dirs import DEVICE_PROFILE, device_profile_path, user_cache_dir
from qnpipe.errors import QnpipeError
from qnpipe.io import measure
from qnpipe.io.device_file import MeasuredProfile, load_profile
from qnpipe.io.sim_model import PROFILES
from qnpipe.plan import load_plan, measured, minimum_budget, model_facts
from qnpipe.plan.make import resolve_device
from qnpipe.replay.synth import SynthSpec, write_synth

FAKE = PROFILES["apple-m5-internal"]


def _fake(calls: list[Path]):  # type: ignore[no-untyped-def]
    def fake(d: Path, **kw: object) -> MeasuredProfile:
        calls.append(d)
        return MeasuredProfile(profile=FAKE, latency_fit_residual_s=0.0, rate_fit_residual=0.0, backend="python",
                               mode="fake", samples=[])
    return fake


def test_the_user_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    if not str(user_cache_dir({"HOME": "/h"})).startswith("/h/Library"):  # not macOS
        assert user_cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/qnpipe")
        assert user_cache_dir({"HOME": "/h"}) == Path("/h/.cache/qnpipe")
    cfg = config.load(None, env={})
    assert cfg.plan.device == "measured" and cfg.read.device_profile_path == ""
    assert device_profile_path(cfg, {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qnpipe" / DEVICE_PROFILE
    given = config.load(None, env={}, overrides={"read.device_profile_path": "x.json"})
    assert device_profile_path(given) == Path("x.json")


def test_measured_once_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(measure, "measure_profile", _fake(calls))
    monkeypatch.setattr(measured, "_measure_in_child", False)  # the fake measures here
    cfg = config.load(None)
    assert resolve_device("measured", cfg) == ("measured", FAKE)
    assert resolve_device(cfg.plan.device, cfg) == ("measured", FAKE)
    assert calls == [tmp_path / "qnpipe"]  # once: the second read the kept file
    assert load_profile(tmp_path / "qnpipe" / DEVICE_PROFILE).profile == FAKE
    # A cache that cannot be written: measured in a temporary directory, used, not kept.
    blocker = tmp_path / "file"
    blocker.write_text("")
    got, where = measure.measured_once(blocker / "sub" / DEVICE_PROFILE, measure=_fake(calls))
    assert got.profile == FAKE and "not kept" in where and len(calls) == 2


def test_the_first_measurement_runs_in_a_child_and_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its read buffers (~0.2 GB) are the child's: the run's own peak resident set, which `--memory` bounds,
    never holds them. This process never measures (its measure_profile raises); the child's profile is kept
    and read back."""
    def here(*a: object, **kw: object) -> MeasuredProfile:
        raise AssertionError("measured in the planning process")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(measure, "measure_profile", here)
    cfg = config.load(None)
    name, got = resolve_device("measured", cfg)
    kept = load_profile(tmp_path / "qnpipe" / DEVICE_PROFILE)
    assert name == "measured" and got == kept.profile and len(kept.samples) == 12  # FIRST_MEASURE's cells
    assert resolve_device("measured", cfg)[1] == got  # read back, not measured again
    assert not [p for p in (tmp_path / "qnpipe").iterdir() if p.name != DEVICE_PROFILE]  # its test files removed


def test_a_failed_measuring_child_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setattr(measured.sys, "executable", false)  # runs, and exits 1 without a profile
    with pytest.raises(QnpipeError, match=r"measuring this machine's device for .*profile.json in a child process .*exit status 1"):
        measured.measured_device(tmp_path / "profile.json")


def test_bench_io_saves_in_the_user_cache_not_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, cwd = tmp_path / "qnpipe", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(cwd)
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-mib", "4", "--seconds", "0.01",
                 "--records", "4096,8192", "--qd", "1,2", "-q"]) == 0
    assert load_profile(cache / DEVICE_PROFILE).samples and not list(cwd.iterdir())


def test_plan_reads_the_recorded_log_and_names_profile_and_cost(tiny_qn4: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_qn4, model)
    cfg = config.load(None, overrides={"model.model_dir": str(model), "plan.process_bytes": 100 * 2**20})
    facts = model_facts(model, cfg)
    s = facts.shape
    recorded = Path(cfg.recorded_log_path())
    write_synth(recorded, SynthSpec(layers=s.num_layers, experts=s.num_experts, top_k=s.top_k, tokens=60, seed=3))
    memory = minimum_budget(facts, cfg, context=512) + 2 * sum(facts.record_nbytes.values())
    out = tmp_path / "plan.json"
    assert main(["plan", str(model), "--memory", str(memory), "--context", "512", "--device", "apple-m5-internal",
                 "-o", str(out), "-q", "--window-layer-steps", "200", "--set", "plan.process_bytes=104857600"]) == 0
    plan = load_plan(out)
    assert plan.log == str(recorded) and not plan.log_synthetic
    text = capsys.readouterr().out
    assert "device profile: apple-m5-internal (" in text and "cost model: " in text
