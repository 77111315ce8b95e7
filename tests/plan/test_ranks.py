"""Each rank's share of the memory account (`--memory` with `--distributed`): the split balances the ranks'
fixed bytes, the shares add up to the whole account, a budget too small is refused naming the rank, and a
rank's plan covers only its layers, its predictions the replay's of the log restricted to them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.plan import make_plan, minimum_budget, model_facts
from qnpipe.plan.account import ModelFacts, fixed_lines
from qnpipe.plan.make import replay_plan
from qnpipe.plan.ranks import (
    Share,
    Weights,
    check_ranks,
    layer_weights,
    memory_split,
    restrict_log,
    share_lines,
    share_minimum,
)
from qnpipe.replay.runner import load_log
from qnpipe.replay.synth import SynthSpec, write_synth

CONTEXT = 1024


def _setup(model: Path, mtp: bool = False) -> tuple[config.Config, ModelFacts, Weights]:
    cfg = config.load(None, overrides={"model.model_dir": str(model), "mtp.enabled": mtp})
    facts = model_facts(model, cfg)
    return cfg, facts, layer_weights(facts, cfg)


def _shares(split: list[tuple[int, int]]) -> list[Share]:
    return [Share(rank=r, ranks=len(split), lo=lo, hi=hi) for r, (lo, hi) in enumerate(split)]


def _splits(n: int, ranks: int) -> list[list[tuple[int, int]]]:
    """Every split of n layers into `ranks` contiguous non-empty ranges."""
    out = []
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        b = [0, *cuts, n]
        out.append(list(itertools.pairwise(b)))
    return out


@pytest.mark.parametrize("mtp", [False, True])
def test_the_shares_add_up_to_the_whole_account(tiny_qn4: Path, mtp: bool) -> None:
    cfg, facts, weights = _setup(tiny_qn4, mtp)
    assert weights.total == facts.non_expert_nbytes
    whole = {x.name: x.nbytes for x in fixed_lines(facts, cfg, context=CONTEXT)}
    one = _shares([(0, facts.args.num_hidden_layers)])
    assert {x.name: x.nbytes for x in share_lines(facts, cfg, weights, one[0], context=CONTEXT)} == whole
    assert share_minimum(facts, cfg, weights, one[0], context=CONTEXT) == minimum_budget(facts, cfg, context=CONTEXT)
    for ranks in (2, 3):
        shares = memory_split(facts, cfg, weights, ranks, context=CONTEXT)
        assert shares[0].lo == 0 and shares[-1].hi == facts.args.num_hidden_layers
        assert all(a.hi == b.lo for a, b in itertools.pairwise(shares))
        lines = [{x.name: x.nbytes for x in share_lines(facts, cfg, weights, s, context=CONTEXT)} for s in shares]
        for name in ("KV cache", "recurrent state"):  # each layer's state on exactly one rank
            assert sum(x[name] for x in lines) == whole[name]
        # the weights: each tensor on one rank, but the embedding also on the last with MTP (it embeds tokens)
        # and the tensors outside layers, embedding and head (none in this model) on every rank
        dup = weights.embed if mtp or weights.tied else 0
        assert sum(x["non-expert weights"] for x in lines) == whole["non-expert weights"] + dup \
            + (ranks - 1) * weights.shared
        for name in ("MLX buffer cache", "OS / page-cache headroom"):  # per process: every rank has it whole
            assert all(x[name] == whole[name] for x in lines)


@pytest.mark.parametrize(("ranks", "mtp"), [(2, False), (3, False), (2, True)])
def test_the_split_balances_the_ranks_fixed_bytes(tiny_qn4: Path, ranks: int, mtp: bool) -> None:
    cfg, facts, weights = _setup(tiny_qn4, mtp)
    shares = memory_split(facts, cfg, weights, ranks, context=CONTEXT)
    worst = max(share_minimum(facts, cfg, weights, s, context=CONTEXT) for s in shares)
    best = min(max(share_minimum(facts, cfg, weights, s, context=CONTEXT) for s in _shares(split))
               for split in _splits(facts.args.num_hidden_layers, ranks))
    assert worst == best  # no split leaves its fullest rank more room for its pool


def test_a_budget_too_small_names_the_rank_its_layers_and_the_least_that_fits(tiny_qn4: Path) -> None:
    cfg, facts, weights = _setup(tiny_qn4)
    shares = memory_split(facts, cfg, weights, 2, context=CONTEXT)
    needs = check_ranks(facts, cfg, weights, shares, [0, 0], context=CONTEXT)  # 0: no --memory on that rank
    assert needs == [share_minimum(facts, cfg, weights, s, context=CONTEXT) for s in shares]
    assert check_ranks(facts, cfg, weights, shares, needs, context=CONTEXT) == needs  # exactly enough fits
    s1 = shares[1]
    with pytest.raises(ConfigError) as e:
        check_ranks(facts, cfg, weights, shares, [needs[0], needs[1] - 1], context=CONTEXT)
    msg = str(e.value)
    assert f"on rank 1 (layers {s1.lo}-{s1.hi - 1}) of 2" in msg and f"({needs[1]} bytes" in msg
    assert "smallest budget that fits its share" in msg and "rank 0" not in msg
    with pytest.raises(ConfigError, match="rank 0 .*; .*rank 1 "):
        check_ranks(facts, cfg, weights, shares, [needs[0] - 1, needs[1] - 1], context=CONTEXT)


def test_a_ranks_plan_covers_its_layers_and_is_the_replay_of_them(tiny_qn4: Path, tmp_path: Path) -> None:
    cfg, facts, weights = _setup(tiny_qn4)
    log = write_synth(tmp_path / "tiny.qtrace", SynthSpec(layers=8, experts=64, top_k=4, tokens=200, seed=3,
                                                          locality=0.2, popularity="zipf:1.2"))
    share = memory_split(facts, cfg, weights, 2, context=CONTEXT)[1]
    held = [ly for ly in facts.args.moe_layers if share.holds(ly)]
    # its routes only, layer ids the whole model's
    restricted = load_log(restrict_log(log, tmp_path / "r.qtrace", share))
    assert restricted.shape.moe_layers == tuple(held)
    assert restricted.steps == [[(ly, ex) for ly, ex in step if share.holds(ly)] for step in load_log(log).steps]
    need = share_minimum(facts, cfg, weights, share, context=CONTEXT)
    budget = need + 6 * sum(facts.record_nbytes[ly] for ly in held)
    plan = make_plan(tiny_qn4, budget, log=log, context=CONTEXT, cfg=cfg, share=share, window_layer_steps=400,
                     synth_path=tmp_path / "synth.qtrace")
    assert plan.share == share and sorted(plan.capacities) == held and plan.shape.moe_layers == tuple(held)
    assert plan.account.total <= budget and max(plan.capacities.values()) > 4
    lines = {x.name: x for x in plan.account.lines}
    assert lines["non-expert weights"].nbytes == weights.of(share) < facts.non_expert_nbytes
    r = replay_plan(plan, tmp_path / "run", cfg)
    assert (r.tok_s, r.hit_rate, r.bytes_per_token) == (plan.predicted_tok_s, plan.predicted_hit_rate,
                                                        plan.predicted_bytes_per_token)
    assert sorted(r.capacities) == held


def test_each_rank_plans_from_its_recorded_log_cached_by_its_layers(tiny_qn4: Path, tmp_path: Path) -> None:
    import shutil

    from qnpipe.plan.startup import plan_for_share

    model = tmp_path / "tiny-qn4"
    shutil.copytree(tiny_qn4, model)
    cfg = config.load(None, overrides={"model.model_dir": str(model), "plan.cache_dir": str(tmp_path / "plans"),
                                       "plan.context_tokens": CONTEXT})
    facts = model_facts(model, cfg)
    weights = layer_weights(facts, cfg)
    shares = memory_split(facts, cfg, weights, 2, context=CONTEXT)
    budget = max(share_minimum(facts, cfg, weights, s, context=CONTEXT) for s in shares) \
        + 4 * sum(facts.record_nbytes.values())
    cfg = config.with_overrides(cfg, {"plan.memory": str(budget)})
    # what `--trace` wrote on rank 1 in a distributed run (qnpipe.live.parallel.join.rank_config's name)
    write_synth(model / "experts" / "trace.rank1.qtrace", SynthSpec(layers=8, experts=64, top_k=4, tokens=200, seed=5))
    plans = {}
    for s in shares:
        said: list[str] = []
        planned, plan = plan_for_share(cfg, facts, s, say=said.append)
        assert plan is not None and plan.share == s and planned.plan.memory == ""
        assert sorted(plan.capacities) == [ly for ly in range(8) if s.holds(ly)]
        assert said[-1].startswith(f"{s.label} of 2: memory ") and "for its layers" in said[-1]
        assert plan.log_synthetic == (s.rank == 0)  # rank 1 planned on its own recorded routes
        plans[s.rank] = plan
        _, again = plan_for_share(cfg, facts, s, say=said.append)
        assert again == plan and "plan reused from" in said[-1]
    assert len(list((tmp_path / "plans").glob("*/plan.json"))) == 2  # one key per rank's layers
