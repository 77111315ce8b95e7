"""The planner: its predictions are the replay's, its allocation never below uniform, bad input refused first."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.errors import CheckpointError, ConfigError, DeviceProfileError
from qnpipe.plan import load_plan, make_plan, make_plans, minimum_budget, model_facts, plan_overrides, save_plan
from qnpipe.plan.fixed import Fixed
from qnpipe.plan.make import replay_plan
from qnpipe.plan.search import Search
from qnpipe.replay.runner import load_log
from qnpipe.replay.synth import SynthSpec, write_synth
from qnpipe.trace.importers import import_log

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
REAL = [("mixtral-jsonl", TRACES / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl.gz", 64),
        ("mixtral-jsonl", TRACES / "Mario928__speculative-moe" / "routing_raw.jsonl.gz", 64),
        ("vllm-jsonl", TRACES / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz", 300)]


@pytest.fixture(scope="module")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log of the tiny model's shape (8 MoE layers x 64 experts, top-4), skewed per layer."""
    return write_synth(tmp_path_factory.mktemp("logs") / "tiny.qtrace",
                       SynthSpec(layers=8, experts=64, top_k=4, tokens=300, seed=3, locality=0.2, cross_layer=0.3,
                                 popularity="zipf:1.2"))


def _budget(tiny_qn4: Path, slots_per_layer: int) -> int:
    cfg = config.load(None)
    facts = model_facts(tiny_qn4, cfg)
    least = minimum_budget(facts, cfg, context=1024)
    return least + (slots_per_layer - 4) * 8 * facts.record_nbytes[0]


def test_predictions_are_the_replays(tiny_qn4: Path, tiny_log: Path, tmp_path: Path) -> None:
    plans = make_plans(tiny_qn4, [_budget(tiny_qn4, 8), _budget(tiny_qn4, 20)], log=tiny_log, context=1024,
                       window_layer_steps=8 * 200)
    for plan in plans:
        assert plan.replay_first_step == 100 and plan.log_steps == 300
        save_plan(tmp_path / "plan.json", plan)
        again = load_plan(tmp_path / "plan.json")
        assert again == plan
        r = replay_plan(again, tmp_path / "run")
        assert (r.tok_s, r.hit_rate, r.bytes_per_token) == (plan.predicted_tok_s, plan.predicted_hit_rate,
                                                            plan.predicted_bytes_per_token)
        assert r.capacities == plan.capacities and r.train_steps == plan.replay_first_step
        assert plan.account.free >= 0 and plan.account.total <= plan.memory_bytes
        assert r.memory_bytes == next(x.nbytes for x in plan.account.lines if x.name == "expert pool")
        uniform = [c for c in plan.candidates if c.allocation == "uniform"]
        assert uniform and plan.predicted_tok_s >= max(c.tok_s for c in uniform)
        assert all(c.total_slots == plan.candidates[0].total_slots for c in plan.candidates)  # equal memory
        over = plan_overrides(plan, tmp_path / "o")
        assert config.load(None, overrides=over).pool.evict_policy == plan.evict_policy


@pytest.mark.parametrize(("fmt", "src", "steps"), REAL, ids=[s.name for _, s, _ in REAL])
def test_planned_slots_never_below_uniform_on_real_traces(fmt: str, src: Path, steps: int, tmp_path: Path) -> None:
    log = tmp_path / "real.qtrace"
    import_log(fmt, src, log, max_steps=steps)
    # On the misses alone (prefill parts not counted) the allocation's hits; with them, its objective.
    s = Search(log, config.load(None), device=_device(), cost=_cost(), record_nbytes=1 << 20, work_dir=tmp_path,
               prefill=False, fixed=Fixed(policy="lru"))
    p = Search(log, config.load(None), device=_device(), cost=_cost(), record_nbytes=1 << 20, work_dir=tmp_path)
    shape = load_log(log).shape
    layers = len(shape.moe_layers)
    better = 0
    for per_layer in range(shape.top_k, shape.num_experts + 1):
        for extra in (0, layers // 2):
            total = per_layer * layers + extra
            planned, uniform = s.curve_rates(s.planned(total)), s.curve_rates(s.uniform(total))
            assert sum(s.planned(total).values()) <= total
            assert planned[0] >= uniform[0], (per_layer, extra)
            better += planned[0] > uniform[0]
            for policy in ("lru", "lfu"):
                mine = p.planned(total, policy)
                assert sum(mine.values()) <= total
                assert p.curve_value(mine, policy) >= p.curve_value(p.uniform(total), policy), (policy, total)
    assert better  # and strictly better somewhere: these traces are skewed across layers


def _device():  # noqa: ANN202
    from qnpipe.io.sim_model import PROFILES

    return PROFILES["apple-m5-internal"]


def _cost():  # noqa: ANN202
    from qnpipe.replay.runner import CostModel

    return CostModel()


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before any curve or replay."""
    def fail(*a: object, **k: object) -> None:
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr("qnpipe.plan.search.mrc", fail)
    monkeypatch.setattr("qnpipe.plan.search.replay", fail)
    monkeypatch.setattr("qnpipe.plan.make.write_synth", fail)


def test_a_budget_below_the_minimum_names_the_smallest(tiny_qn4: Path, tiny_log: Path, no_work: None) -> None:
    least = minimum_budget(model_facts(tiny_qn4, config.load(None)), config.load(None), context=1024)
    with pytest.raises(ConfigError, match=rf"smallest budget that fits this model, .*\({least} bytes"):
        make_plan(tiny_qn4, least - 1, log=tiny_log, context=1024)


def test_a_log_of_another_shape_is_refused(tiny_qn4: Path, tmp_path: Path, no_work: None) -> None:
    other = write_synth(tmp_path / "other.qtrace", SynthSpec(layers=8, experts=32, top_k=4, tokens=10))
    with pytest.raises(ConfigError, match="another model shape"):
        make_plan(tiny_qn4, _budget(tiny_qn4, 8), log=other, context=1024)


def test_an_unreadable_device_profile_is_refused(tiny_qn4: Path, tiny_log: Path, tmp_path: Path,
                                                 no_work: None) -> None:
    bad = tmp_path / "device.json"
    bad.write_text("{not json")
    with pytest.raises(DeviceProfileError, match=str(bad)):
        make_plan(tiny_qn4, _budget(tiny_qn4, 8), log=tiny_log, device=bad, context=1024)
    with pytest.raises(ConfigError, match="no-such-device"):
        make_plan(tiny_qn4, _budget(tiny_qn4, 8), log=tiny_log, device="no-such-device", context=1024)


def test_a_directory_that_is_not_a_model_is_refused(tmp_path: Path, no_work: None) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        make_plan(tmp_path, "8GB")


def _log_with_candidates(src: Path, out: Path, *, wrong: bool) -> Path:
    """`src`'s routes as an event log with the next layer's true experts (or, `wrong`, others) as each
    layer's gate candidates."""
    from qnpipe import trace
    from qnpipe.messages import Candidates

    log = load_log(src)
    w = trace.TraceWriter(out, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=log.shape,
                                            clock_start_t=0.0, wall_start_unix_s=0.0, contents="events"))
    seq = 0
    for s, step in enumerate(log.steps, start=1):
        for i, (layer, experts) in enumerate(step):
            w.write(trace.Route(t=0.0, seq=seq, step=s, layer=layer, top_k=log.shape.top_k, experts=experts))
            seq += 1
            if i + 1 < len(step):
                nxt = step[i + 1][1]
                if wrong:
                    nxt = tuple(e for e in range(log.shape.num_experts) if e not in nxt)[-len(nxt):]
                w.write(Candidates(t=0.0, seq=seq, step=s, layer=layer, target=step[i + 1][0], width=len(nxt),
                                   token_experts=nxt, token_scores=tuple(1.0 for _ in nxt), deadline=0.0))
                seq += 1
    w.close(0, 0.0)
    return out


def test_prefetch_only_where_it_beats_demand_at_equal_memory(tiny_qn4: Path, tiny_log: Path, tmp_path: Path) -> None:
    from qnpipe.io.simssd import DeviceProfile

    device = DeviceProfile(bandwidth_bytes_per_s=2e6, latency_s=1e-3, queue_depth=4)  # slow: reads worth hiding
    chose = set()
    for wrong in (False, True):  # the true next experts pay; wrong guesses only take bandwidth and slots
        log = _log_with_candidates(tiny_log, tmp_path / f"events-{wrong}.qtrace", wrong=wrong)
        plan = make_plan(tiny_qn4, _budget(tiny_qn4, 8), log=log, device=device, context=1024,
                         window_layer_steps=8 * 100)
        demand = max(c.tok_s for c in plan.candidates if not c.prefetch)
        pre = [c for c in plan.candidates if c.prefetch]
        assert len(pre) == 1 and pre[0].total_slots == plan.candidates[0].total_slots
        assert plan.prefetch == (pre[0].tok_s > demand)
        assert plan.predicted_tok_s == max(demand, pre[0].tok_s)
        r = replay_plan(plan, tmp_path / "run")
        assert (r.tok_s, r.hit_rate) == (plan.predicted_tok_s, plan.predicted_hit_rate)
        chose.add(plan.prefetch)
    assert chose == {True, False}
