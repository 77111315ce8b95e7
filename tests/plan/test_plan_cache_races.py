"""The plan cache under two planners at once, a planner killed mid-write, and a read-only model directory:
no collision (every temporary file has a name of its own), no torn file at a cache name, a clear message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.plan import load_plan, minimum_budget, model_facts
from qnpipe.plan.startup import plan_at_startup
from qnpipe.replay.log import load_log

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512
PROCESS = 100 * 2**20  # pinned: every process plans the same account


@pytest.fixture
def model(tiny_qn4: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tiny-qn4"
    shutil.copytree(tiny_qn4, out)
    return out


def _sets(model: Path) -> dict[str, object]:
    cfg = config.load(overrides={"model.model_dir": str(model), "plan.process_bytes": PROCESS})
    facts = model_facts(model, cfg)
    memory = minimum_budget(facts, cfg, context=CONTEXT) + 2 * sum(facts.record_nbytes.values())
    return {"model.model_dir": str(model), "plan.memory": str(memory), "plan.context_tokens": CONTEXT,
            "plan.process_bytes": PROCESS, "plan.device": "apple-m5-internal"}  # one device for all: the cache key


_PLANNER = ("import json, sys\nfrom qnpipe import config\nfrom qnpipe.plan.startup import plan_at_startup\n"
            "_, plan = plan_at_startup(config.load(overrides=json.loads(sys.argv[1])), say=print)\n"
            "assert plan is not None\n")


def _planner(sets: dict[str, object]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", _PLANNER, json.dumps(sets)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _whole(plans: Path) -> None:
    """Every file at a cache name is whole: each plan loads, the synthetic log reads to its footer."""
    for p in plans.glob("*/plan.json"):
        load_plan(p)
    for p in plans.glob("*/capacities.json"):
        assert "layer_caps" in json.loads(p.read_text())
    for p in plans.glob("synth-*.qtrace"):
        assert load_log(p).steps


def test_two_planners_at_once_share_one_cache(model: Path) -> None:
    sets = _sets(model)
    procs = [_planner(sets) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]  # a hang guard
    assert [p.returncode for p in procs] == [0, 0, 0], [e.decode() for _, e in outs]
    plans = model / "experts" / "plans"
    [cached] = plans.glob("*/plan.json")
    _whole(plans)
    # Each wrote under a name of its own and renamed: nothing half-written is left behind.
    assert not [p for p in plans.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    said: list[str] = []
    plan_at_startup(config.load(overrides=sets), say=said.append)
    assert f"plan reused from {cached}" in said[-1]


def test_a_planner_killed_mid_write_leaves_no_torn_cache(model: Path) -> None:
    sets = _sets(model)
    plans = model / "experts" / "plans"
    victim = _planner(sets)
    deadline = time.monotonic() + 120  # a hang guard
    while not plans.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)  # reaps it and closes its pipes
    _whole(plans)  # whatever it got to: no cache name holds a torn file
    said: list[str] = []
    _, plan = plan_at_startup(config.load(overrides=sets), say=said.append)
    assert plan is not None and ("cached at" in said[-1] or "plan reused from" in said[-1]), said
    _whole(plans)


def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan in this process (what the planning child runs: qnpipe.plan.child.plan_here), so a patch reaches it."""
    from qnpipe.plan.child import plan_here

    monkeypatch.setattr("qnpipe.plan.startup.plan_in_child", lambda cfg, budget, **kw: (plan_here(cfg, budget, **kw),
                                                                                         None))


def test_an_interrupted_synthetic_log_leaves_nothing(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qnpipe.plan import make

    _in_process(monkeypatch)
    real = make.write_synth

    def torn(path: Path, spec: object, **_: object) -> Path:
        Path(path).write_bytes(b"half a log")
        raise KeyboardInterrupt

    monkeypatch.setattr(make, "write_synth", torn)
    plans = model / "experts" / "plans"
    with pytest.raises(KeyboardInterrupt):
        plan_at_startup(config.load(overrides=_sets(model)))
    assert not list(plans.glob("synth-*")) and not [p for p in plans.rglob("*") if p.suffix == ".tmp"]
    monkeypatch.setattr(make, "write_synth", real)
    _, plan = plan_at_startup(config.load(overrides=_sets(model)))
    assert plan is not None
    _whole(plans)


@pytest.fixture
def read_only(model: Path, tmp_path: Path) -> Iterator[Path]:
    """`model` bind-mounted read-only (skipped where mounts are not allowed)."""
    ro = tmp_path / "ro-model"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(model), str(ro)], capture_output=True, timeout=20).returncode:
        pytest.skip("no mount rights for a read-only bind mount")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, timeout=20)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.decode(errors='replace').strip()}")
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True, timeout=20)


def test_a_read_only_model_directory_plans_uncached_and_says_so(read_only: Path) -> None:
    said: list[str] = []
    cfg, plan = plan_at_startup(config.load(overrides=_sets(read_only)), say=said.append)
    assert plan is not None
    assert "not cached: " in said[-1] and "Read-only file system" in said[-1], said
    profile = Path(cfg.pool.capacity_profile_path)
    assert not profile.is_relative_to(read_only) and "removed at exit" in said[-1]
    assert json.loads(profile.read_text())["layer_caps"]


def test_planning_above_the_budget_is_said(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning runs before the model loads, in a child process: its peak above the budget is said (the
    child's real plan, its peak made one byte above the budget)."""
    from qnpipe.plan import child

    sets = _sets(model)
    real = child.plan_in_child
    monkeypatch.setattr("qnpipe.plan.startup.plan_in_child",
                        lambda cfg, budget, **kw: (real(cfg, budget, **kw)[0], int(str(sets["plan.memory"])) + 1))
    said: list[str] = []
    plan_at_startup(config.load(overrides=sets), say=said.append)
    assert any(s.startswith("planning itself (a child process, before the model loads) peaked at ")
               and "above the budget" in s for s in said), said
    said.clear()  # a cached plan plans nothing
    plan_at_startup(config.load(overrides=sets), say=said.append)
    assert not any("planning itself" in s for s in said)


def test_synthetic_logs_written_at_once_do_not_collide(tmp_path: Path) -> None:
    """Four writers of one synthetic log at once (as planners of one model share the cache's): each under a
    name of its own, so none fails and the log reads whole. (Written at one shared partial name, 13 of 20
    writers here failed: 'cannot write the routing log (No such file or directory)'.)"""
    import threading

    from qnpipe.plan.make import synthetic_log
    from qnpipe.trace import ModelShape

    class Facts:
        source = "tiny"
        shape = ModelShape(num_layers=8, moe_layers=tuple(range(8)), num_experts=64, top_k=4, hidden_size=0)

    errors: list[BaseException] = []
    for round_ in range(3):
        path = tmp_path / f"synth-{round_}.qtrace"

        def write(p: Path = path) -> None:
            try:
                synthetic_log(Facts(), p)  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - gathered for the assert
                errors.append(e)

        threads = [threading.Thread(target=write) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)  # a hang guard
        assert load_log(path).steps
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"synth-{r}.qtrace" for r in range(3)]


def test_a_given_buffer_cache_has_its_own_cache_entry(model: Path) -> None:
    """memory.mlx_cache_limit_gb given (even at its default) plans otherwise than derived: one key each, so two
    such runs at one budget reuse their own plans instead of re-planning over each other."""
    sets = _sets(model)
    cfg = config.load(overrides={**sets, "memory.mlx_cache_limit_gb": 1.0})
    facts = model_facts(model, cfg)
    sets["plan.memory"] = str(minimum_budget(facts, cfg, context=CONTEXT) + 2 * sum(facts.record_nbytes.values()))
    for given in ({}, {"memory.mlx_cache_limit_gb": 1.0}, {}, {"memory.mlx_cache_limit_gb": 1.0}):
        plan_at_startup(config.load(overrides={**sets, **given}), say=lambda _: None)
    plans = sorted(p.parent.name for p in (model / "experts" / "plans").glob("*/plan.json"))
    assert len(plans) == 2, plans
    for given in ({}, {"memory.mlx_cache_limit_gb": 1.0}):
        said: list[str] = []
        plan_at_startup(config.load(overrides={**sets, **given}), say=said.append)
        assert "plan reused from" in said[-1], said
