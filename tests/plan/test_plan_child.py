"""Planning at start-up runs in a child process (qnpipe.plan.child): the same plan as in this process, the
child's errors as this process's, its working set not in this process's peak, Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from qnpipe import config
from qnpipe.errors import QnpipeError, TraceSchemaError
from qnpipe.plan import minimum_budget, model_facts
from qnpipe.plan.child import ChildFailure, plan_here, plan_in_child, remade
from qnpipe.plan.startup import plan_at_startup

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512


@pytest.fixture
def model(tiny_qn4: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tiny-qn4"
    shutil.copytree(tiny_qn4, out)
    return out


def _sets(model: Path, **more: object) -> dict[str, object]:
    # memory.mlx_cache_limit_gb given at its default: the account names where a given setting came from,
    # which the child must keep (config.rebuilt).
    sets = {"model.model_dir": str(model), "plan.context_tokens": CONTEXT, "plan.device": "apple-m5-internal",
            "memory.mlx_cache_limit_gb": 1.0, **more}
    cfg = config.load(overrides=sets)
    facts = model_facts(model, cfg)
    return {**sets, "plan.memory": str(minimum_budget(facts, cfg, context=CONTEXT) + 2 * sum(facts.record_nbytes.values()))}


def _synth(model: Path, tmp: Path, tokens: int) -> Path:
    """A synthetic routing log of the model's shape with `tokens` steps (a planning working set to size)."""
    from qnpipe.plan.make import synth_spec
    from qnpipe.replay.synth import write_synth

    facts = model_facts(model, config.load(overrides={"model.model_dir": str(model)}))
    return write_synth(tmp / "big.qtrace", msgspec.structs.replace(synth_spec(facts.shape), tokens=tokens))


def test_the_child_plans_what_this_process_would(model: Path) -> None:
    cfg = config.load(overrides={k: v for k, v in _sets(model).items() if k != "plan.memory"})
    budget = int(str(_sets(model)["plan.memory"]))
    there, peak = plan_in_child(cfg, budget, log=None, synth_path=None, share=None)
    here = plan_here(cfg, budget, log=None, synth_path=None, share=None)
    assert peak is None or peak > 0
    # Every field but the planning's own wall time (and the synthetic log's private path).
    def same(p: object) -> object:
        return msgspec.structs.replace(p, plan_s=0.0, log="")  # type: ignore[type-var]

    assert same(there) == same(here)
    assert any("given" in line.source for line in there.account.lines)  # the given setting's source kept


def test_an_error_in_the_child_is_raised_here_with_its_class_and_message(model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "not-a-log.qtrace"
    bad.write_bytes(b"not a routing log at all")
    sets = _sets(model, **{"plan.log": str(bad)})
    cfg = config.load(overrides={k: v for k, v in sets.items() if k != "plan.memory"})
    budget = int(str(sets["plan.memory"]))
    with pytest.raises(QnpipeError) as here:
        plan_here(cfg, budget, log=bad, synth_path=None, share=None)
    with pytest.raises(QnpipeError) as there:
        plan_in_child(cfg, budget, log=bad, synth_path=None, share=None)
    assert type(there.value) is type(here.value) and str(there.value) == str(here.value)
    # Through plan_at_startup too: the message names the file.
    with pytest.raises(type(here.value), match="not-a-log"):
        plan_at_startup(config.load(overrides=sets))


def test_a_class_that_cannot_be_remade_falls_back_to_the_nearest_qnpipe_class() -> None:
    failed = ChildFailure(classes=[("qnpipe.nowhere", "Gone"), ("qnpipe.errors", "TraceSchemaError"),
                              ("qnpipe.errors", "QnpipeError")], message="m")
    assert type(remade(failed)) is TraceSchemaError and str(remade(failed)) == "m"
    assert type(remade(ChildFailure(classes=[("builtins", "FileNotFoundError")], message="gone"))) is FileNotFoundError
    assert type(remade(ChildFailure(classes=[("builtins", "ValueError")], message="x"))) is QnpipeError  # not ours


_PEAKS = ("import json, sys\nfrom qnpipe import config\nfrom qnpipe.plan.process import high_water_bytes, measure_process\n"
          "from qnpipe.plan.child import plan_here\nfrom qnpipe.plan.startup import plan_at_startup\n"
          "sets = json.loads(sys.argv[2])\ncfg = config.load(overrides=sets)\nmeasure_process()\n"
          "before = high_water_bytes()\n"
          "if sys.argv[1] == 'here':\n"
          "    plan_here(config.load(overrides={k: v for k, v in sets.items() if k != 'plan.memory'}),\n"
          "              int(sets['plan.memory']), log=sets['plan.log'], synth_path=None, share=None)\n"
          "else:\n"
          "    plan_at_startup(cfg)\n"
          "print(json.dumps([before, high_water_bytes()]))\n")


def _growth(where: str, sets: dict[str, object]) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _PEAKS, where, json.dumps(sets)], env=env, capture_output=True,
                         text=True, check=True, timeout=600).stdout  # a hang guard
    before, after = json.loads(out.splitlines()[-1])
    return after - before


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="VmHWM from /proc")
def test_this_process_peak_does_not_hold_the_planning(model: Path, tmp_path: Path) -> None:
    """The planner's working set (a 5,000-step log's curves and replays: 92 MB
    at 20,000 steps, where the child left the mark 2.3 MB higher) raises a process's high-water mark
    when it plans there; planning at start-up (in a child) leaves the run's own mark where it was."""
    sets = _sets(model, **{"plan.log": str(_synth(model, tmp_path, 5_000)), "plan.cache_dir": str(tmp_path / "c")})
    here = _growth("here", sets)
    startup = _growth("startup", sets)
    assert here > 8 << 20, here  # the working set is there to see
    assert startup < here / 4, (startup, here)


def _planning(model: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    """A process planning at start-up (a 50,000-step log: seconds of planning), once its planning child runs."""
    sets = _sets(model, **{"plan.log": str(_synth(model, tmp_path, 50_000)), "plan.cache_dir": str(tmp_path / "c")})
    code = ("import json, sys\nfrom qnpipe import config\nfrom qnpipe.plan.startup import plan_at_startup\n"
            "plan_at_startup(config.load(overrides=json.loads(sys.argv[1])))\n")
    (tmp_path / "t").mkdir()  # the run's temporary directories, the child's plan.json and done.json in one
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path / "t")}
    parent = subprocess.Popen([sys.executable, "-c", code, json.dumps(sets)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    deadline = time.monotonic() + 120  # a hang guard
    kids: list[str] = []
    while not kids and parent.poll() is None and time.monotonic() < deadline:
        kids = children.read_text().split() if children.exists() else []
        time.sleep(0.02)
    assert kids, "no planning child seen"
    time.sleep(0.5)  # into the planning
    return parent, kids


def _gone(kids: list[str]) -> bool:
    deadline = time.monotonic() + 30  # a hang guard
    while time.monotonic() < deadline:
        if not [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in _state(k)]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a process's children from /proc")
def test_ctrl_c_stops_the_planning_child(model: Path, tmp_path: Path) -> None:
    parent, kids = _planning(model, tmp_path)
    parent.send_signal(signal.SIGINT)  # to the parent alone: it ends the child
    _, err = parent.communicate(timeout=120)
    assert parent.returncode != 0 and b"KeyboardInterrupt" in err, err.decode()
    assert _gone(kids)
    assert not list((tmp_path / "c").glob("*/plan.json"))  # nothing cached from an interrupted plan


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_a_killed_run_takes_its_planning_child_with_it(model: Path, tmp_path: Path) -> None:
    parent, kids = _planning(model, tmp_path)
    parent.send_signal(signal.SIGKILL)
    parent.communicate(timeout=60)
    assert _gone(kids)
    # Killed with it, not left to plan to the end for nobody (its plan would be in the run's temporary dir).
    assert not list((tmp_path / "t").rglob("done.json")) and not list((tmp_path / "t").rglob("plan.json"))


def _state(pid: str) -> str:
    try:
        return next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("State:"))
    except (OSError, StopIteration):
        return "Z"
