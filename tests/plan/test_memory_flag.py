"""`--memory` on generate/chat/serve and `Engine(memory=...)`: the plan applied before loading, cached, refused when
it cannot fit; the tokens do not change (capacity invariance)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from qnpipe import config
from qnpipe.cli import main
from qnpipe.errors import ConfigError
from qnpipe.plan import minimum_budget, model_facts
from qnpipe.plan.startup import plan_at_startup

CONTEXT = 512
TOKENS = [3, 17, 5, 99, 42, 7, 8, 250, 11, 64]


@pytest.fixture(scope="module")
def model(tiny_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of tiny_qn4 (the tests write its recorded log and plan cache into its expert dir)."""
    out = tmp_path_factory.mktemp("mem") / "tiny-qn4"
    shutil.copytree(tiny_qn4, out)
    return out


def budget(model: Path, slots_over_topk: int = 2) -> int:
    """A budget of top-k + `slots_over_topk` slots per MoE layer beyond the fixed lines."""
    cfg = config.load(overrides={"model.model_dir": str(model)})
    facts = model_facts(model, cfg)
    return (minimum_budget(facts, cfg, context=CONTEXT)
            + slots_over_topk * sum(facts.record_nbytes.values()))


def cfg_for(model: Path, cache: Path, memory: int | str, **kw: object) -> config.Config:
    return config.load(overrides={"model.model_dir": str(model), "plan.memory": str(memory),
                                  "plan.cache_dir": str(cache), "plan.context_tokens": CONTEXT, **kw})


@pytest.mark.slow
def test_plan_cached_reused_and_corrupt_cache_ignored(model: Path, tmp_path: Path) -> None:
    said: list[str] = []
    cfg, plan = plan_at_startup(cfg_for(model, tmp_path, budget(model)), say=said.append)
    assert plan is not None and cfg.plan.memory == ""
    assert "synthetic log" in said[0] and "--trace" in said[0]
    assert said[-1].startswith("memory ") and "cached at" in said[-1] and "slots per layer" in said[-1]
    [cached] = tmp_path.glob("*/plan.json")
    caps = json.loads(Path(cfg.pool.capacity_profile_path).read_text())["layer_caps"]
    assert {int(k): v for k, v in caps.items()} == plan.capacities
    said.clear()
    _, again = plan_at_startup(cfg_for(model, tmp_path, budget(model)), say=said.append)
    assert f"plan reused from {cached}" in said[-1] and again == plan
    cached.write_text("{not json")
    said.clear()
    _, third = plan_at_startup(cfg_for(model, tmp_path, budget(model)), say=said.append)
    assert any(s.startswith(f"ignoring the cached plan {cached}:") for s in said)
    assert third is not None and third.capacities == plan.capacities and "cached at" in said[-1]
    said.clear()  # another budget: another key, planned anew
    plan_at_startup(cfg_for(model, tmp_path, budget(model, 3)), say=said.append)
    assert "plan reused from" not in said[-1] and len(list(tmp_path.glob("*/plan.json"))) == 2


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize(("extra", "says"), [
    ({"pool.capacity_profile_path": "caps.json"}, "both choose the slots per layer"),
    ({"plan.log": "nowhere.qtrace"}, "plan.log=nowhere.qtrace"),
])
def test_conflicts_refused(model: Path, tmp_path: Path, extra: dict[str, object], says: str,
                           distributed: bool) -> None:
    with pytest.raises(ConfigError, match=says):  # distributed too: before the ring starts
        plan_at_startup(cfg_for(model, tmp_path, budget(model), **extra), distributed=distributed)


def test_distributed_leaves_the_plan_to_each_rank(model: Path, tmp_path: Path) -> None:
    # Each rank plans its own layers once the ring has split them (tests/distributed/test_ring_memory.py).
    cfg = cfg_for(model, tmp_path, budget(model), **{"distributed.enabled": True})
    assert plan_at_startup(cfg) == (cfg, None) and not list(tmp_path.iterdir())


def test_too_small_refused_before_loading(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import qnpipe.live.loaded as core

    def no_load(*a: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(core, "load_model", no_load)
    least = budget(model, 0)
    for cmd in (["generate", str(model), "--tokens", "1,2"], ["chat", str(model)], ["serve", str(model)]):
        assert main([*cmd, "--memory", str(least - 1), "--set", f"plan.cache_dir={tmp_path}",
                     "--set", f"plan.context_tokens={CONTEXT}"]) == 2
        err = capsys.readouterr().err
        assert "smallest budget that fits" in err and f"({least} bytes" in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_generate_memory_applies_plan_and_keeps_tokens(model: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", str(model), "--tokens", ",".join(map(str, TOKENS)), "-n", "6", "--json",
            "--set", "plan.context_tokens=512", "--set", f"plan.cache_dir={tmp_path}"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--memory", str(budget(model))]) == 0
    out = capsys.readouterr()
    planned = json.loads(out.out)
    line = out.err.strip().splitlines()[-1]
    assert line.startswith("qnpipe generate: memory ") and "slots per layer" in line
    [cached] = tmp_path.glob("*/capacities.json")
    caps = {int(k): v for k, v in json.loads(cached.read_text())["layer_caps"].items()}
    assert {ly["layer"]: ly["capacity"] for ly in planned["engine"]["pool"]["layers"]} == caps
    assert max(caps.values()) < max(ly["capacity"] for ly in plain["engine"]["pool"]["layers"])
    assert planned["tokens"] == plain["tokens"]


def test_recorded_log_is_planned_from(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recorded = model / "experts" / "trace.qtrace"
    assert main(["generate", str(model), "--tokens", ",".join(map(str, TOKENS)), "-n", "8", "--trace"]) == 0
    assert recorded.is_file()
    capsys.readouterr()
    said: list[str] = []
    _, plan = plan_at_startup(cfg_for(model, tmp_path, budget(model)), say=said.append)
    assert plan is not None and plan.log == str(recorded) and not plan.log_synthetic
    assert not any("synthetic" in s for s in said)
    recorded.unlink()


@pytest.mark.slow
def test_engine_memory_logits_bit_identical(model: Path, tmp_path: Path) -> None:
    from qnpipe.engine import Engine

    with Engine(model, cache_dir=str(tmp_path), context_tokens=CONTEXT) as eng:
        plain = eng.logits(TOKENS)
    with Engine(model, memory=str(budget(model)), cache_dir=str(tmp_path), context_tokens=CONTEXT) as eng:
        assert eng.plan is not None
        planned = eng.logits(TOKENS)
        pool = eng.stats().pool
        assert pool is not None and {ly.layer: ly.capacity for ly in pool.layers} == eng.plan.capacities
        assert pool.misses > 0
    assert np.array_equal(plain, planned)


@pytest.mark.slow
async def test_open_engine_memory(model: Path, tmp_path: Path) -> None:
    from qnpipe.engine import open_engine

    async with open_engine(model, memory=str(budget(model)), cache_dir=str(tmp_path), context_tokens=CONTEXT) as eng:
        assert eng.plan is not None and eng.cfg.pool.capacity_profile_path.startswith(str(tmp_path))
        pool = eng.stats().pool
        assert pool is not None and {ly.layer: ly.capacity for ly in pool.layers} == eng.plan.capacities
