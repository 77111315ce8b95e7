"""`qnpipe plan` and `generate --memory` on a tiny model of each first family (registry.FIRST): the plan a
process makes for itself holds its budget live (the process's peak resident set, VmHWM), the live pool's
hits are the replay's of the run's own log under the plan, and `qnpipe plan` makes the same plan."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.cli import main
from qnpipe.model.family.registry import FIRST, NO_SNAPSHOTS, TESTED
from qnpipe.plan import load_plan, plan_overrides
from qnpipe.replay import replay

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 256
EXTRA_SLOTS = 3  # the budget: the smallest that fits and 3 more records of every MoE layer
PROMPT = "5,17,300,900,42,7,1000,3"

# The child plans its own budget (the smallest that fits in this process, whose resident set the account
# measures, plus EXTRA_SLOTS records per layer), runs `generate --memory` with it, and writes its VmHWM.
_CHILD = """
import json, sys
from qnpipe import config
from qnpipe.cli import main
from qnpipe.plan import minimum_budget
from qnpipe.plan.family_account import dir_facts
model, context, extra, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = config.load(None, overrides={"compute.cpu_blas": "bundled"})
facts = dir_facts(model, cfg)
budget = minimum_budget(facts, cfg, context=context) + extra * sum(facts.record_nbytes.values())
rc = main([*sys.argv[5:], "--memory", str(budget)])
hwm = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
open(out, "w").write(json.dumps({"budget": budget, "hwm": int(hwm.split()[1]) * 1024}))
sys.exit(rc)
"""


def _tiny_converted(tmp: Path, family: str) -> Path:
    """`qnpipe make-tiny --family FAMILY`, then `qnpipe convert`."""
    src, out = tmp / f"{family}-src", tmp / family
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["make-tiny", "--family", family, "--seed", "1", str(src)]) == 0
        assert main(["convert", str(src), "--out", str(out), "-q"]) == 0
    return out


@pytest.mark.parametrize("family", FIRST)
def test_plan_of_a_family_holds_its_budget_and_hits_are_the_replays(tmp_path: Path, family: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = _tiny_converted(tmp_path, family)
    # The machine's device profile, when the first test to need it is this one, is measured in a child of the
    # child (qnpipe.plan.measured): its ~0.2 GB of read buffers are never in the peak checked here.
    events, said = tmp_path / "run.qtrace", tmp_path / "child.json"
    sets = {"plan.context_tokens": CONTEXT, "plan.cache_dir": tmp_path / "plans", "compute.cpu_blas": "bundled"}
    argv = ["generate", str(model), "--tokens", PROMPT, "-n", "4", "--json", "--trace", str(events),
            *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(CONTEXT), str(EXTRA_SLOTS), str(said), *argv],
                       capture_output=True, text=True, env=env, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    child = json.loads(said.read_text())
    plan = load_plan(p.stderr.split("cached at ")[1].split("]")[0])
    live = json.loads(p.stdout)["engine"]["pool"]
    # The budget holds live: the whole process's peak resident set, not MLX's arrays alone.
    assert plan.memory_bytes == child["budget"] and child["hwm"] <= child["budget"], child
    assert plan.account.total <= plan.memory_bytes
    # The pool ran the plan's slots, and the replay of the run's own routes under the plan gives its hits.
    assert [x["capacity"] for x in live["layers"]] == [plan.capacities[x["layer"]] for x in live["layers"]]
    r = replay(events, config.load(None, overrides=plan_overrides(plan, tmp_path / "replay")))
    assert r.steps == live["steps"]
    assert [x.hits for x in r.layers] == [x["hits"] for x in live["layers"]], family
    assert r.hit_rate == live["hit_rate"] and r.misses_by_cause == live["misses_by_cause"]
    # `qnpipe plan` makes the same plan, given the process line the child measured for itself.
    process = next(x.nbytes for x in plan.account.lines if x.name == "process outside MLX")
    out = tmp_path / "plan.json"
    capsys.readouterr()
    assert main(["plan", str(model), "--memory", str(plan.memory_bytes), "--context", str(CONTEXT), "-q", "-o",
                 str(out), "--set", f"plan.process_bytes={process}"]) == 0
    again = load_plan(out)
    assert (again.capacities, again.evict_policy, again.prefetch) == (plan.capacities, plan.evict_policy,
                                                                      plan.prefetch)
    assert (again.predicted_tok_s, again.predicted_hit_rate) == (plan.predicted_tok_s, plan.predicted_hit_rate)


def test_a_synthetic_log_routes_at_the_models_moe_layers(tmp_path: Path) -> None:
    """A model with dense layers (here: MoE at 0 and 2 of 3) is planned on a synthetic log of its MoE layers."""
    from qnpipe.errors import ConfigError
    from qnpipe.replay.runner import load_log
    from qnpipe.replay.synth import SynthSpec, write_synth

    spec = SynthSpec(layers=2, experts=8, top_k=2, tokens=5, seed=1)
    log = load_log(write_synth(tmp_path / "s.qtrace", spec, moe_layers=(0, 2), num_layers=3))
    assert log.shape.moe_layers == (0, 2) and log.shape.num_layers == 3
    plain = load_log(write_synth(tmp_path / "p.qtrace", spec))
    assert plain.shape.moe_layers == (0, 1)
    for bad in ((0,), (2, 0), (1, 3)):
        with pytest.raises(ConfigError, match="synth moe_layers=.*distinct increasing layer ids in \\[0, 3\\)"):
            write_synth(tmp_path / "bad.qtrace", spec, moe_layers=bad, num_layers=3)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in TESTED if f not in FIRST])
def test_qnpipe_plan_takes_every_family(tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The broad sweep: every other tested family is planned from its own files (at --context), or refused
    by name where its cache kind cannot be sized (registry.NO_SNAPSHOTS)."""
    model = _tiny_converted(tmp_path, family)
    argv = ["plan", str(model), "--memory", "4GB", "--context", str(CONTEXT), "-q", "-o", str(tmp_path / "p.json")]
    if family in NO_SNAPSHOTS:
        assert main(argv) != 0
        assert "the plan cannot size it" in capsys.readouterr().err
        return
    assert main(argv) == 0
    plan = load_plan(tmp_path / "p.json")
    assert plan.account.total <= plan.memory_bytes and sorted(plan.capacities) == sorted(
        load_log_shape(tmp_path / "p.json.synth.qtrace"))


def load_log_shape(path: Path) -> tuple[int, ...]:
    from qnpipe.replay.runner import load_log

    return load_log(path).shape.moe_layers
