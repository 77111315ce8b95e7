"""`--memory` with two ranks on localhost (`open_engine(memory=..., distributed=True)`): the layers split by
the memory account, each rank's plan made for its own layers in its own budget, the tokens and logits one
process's (capacities never change them); a budget too small for a rank's share refused on every rank."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from qnpipe import config
from qnpipe.plan import load_plan, model_facts
from qnpipe.plan.ranks import layer_weights, memory_split, share_minimum
from tests.distributed.test_ring import PROMPT, _finish, _start

pytestmark = pytest.mark.slow  # rings of processes, each loading the model

CONTEXT = 512
STREAM: dict[str, Any] = {"expert_slots": 4, "prefill_chunk_tokens": 5}  # a top-k pool: every expert streamed
# The account's process line, pinned: measured, it would be each process's own (this one's and the ranks' differ).
PROCESS = 100 * 2**20


def _needs(model: Path) -> tuple[list[tuple[int, int]], list[int], int]:
    """(the memory split of 2 ranks, each rank's smallest budget, the bytes of every MoE layer's record)."""
    cfg = config.load(None, overrides={"model.model_dir": str(model), "plan.process_bytes": PROCESS,
                                       "forward.prefill_chunk_tokens": 5})  # the ranks' (the activations line)
    facts = model_facts(model, cfg)
    weights = layer_weights(facts, cfg)
    shares = memory_split(facts, cfg, weights, 2, context=CONTEXT)
    return ([(s.lo, s.hi) for s in shares], [share_minimum(facts, cfg, weights, s, context=CONTEXT) for s in shares],
            sum(facts.record_nbytes.values()))


@pytest.fixture(scope="module")
def one_process_stream(tiny_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """What one process makes of the prompt through a top-k pool (rank_main.py's `_plain`)."""
    from qnpipe import open_engine

    async def run() -> dict[str, np.ndarray]:
        async with open_engine(tiny_qn4, **STREAM) as eng:
            return {"logits": await eng.logits(PROMPT), "next": await eng.next_logits(PROMPT),
                    "greedy": np.array((await eng.generate(PROMPT, max_tokens=6, stop_at_eos=False)).tokens),
                    "sampled": np.array((await eng.generate(PROMPT, max_tokens=6, temperature=0.8, seed=3,
                                                            stop_at_eos=False)).tokens)}

    with contextlib.chdir(tmp_path_factory.mktemp("one-mem")):
        return trio.run(run)


def _scenario(memory: int, cache: Path) -> dict:
    return {"prompt": PROMPT, "tokens": 6,
            "engines": {"mem": {"memory": str(memory), "context_tokens": CONTEXT, "cache_dir": str(cache),
                                "prefill_chunk_tokens": 5, "plan.process_bytes": PROCESS}}}


def test_two_ranks_plan_their_own_layers_and_give_one_process_bits(tiny_qn4: Path, tmp_path: Path,
                                                                   one_process_stream: dict[str, np.ndarray]) -> None:
    split, needs, records = _needs(tiny_qn4)
    budget = max(needs) + 3 * records  # room for more than top-k slots on either rank
    results = _finish(_start(2, tiny_qn4, tmp_path, _scenario(budget, tmp_path / "plans")), timeout_s=240)
    for r, (rc, err) in enumerate(results):
        assert rc == 0, f"rank {r} exited {rc}:\n{err[-3000:]}"
        lo, hi = split[r]
        said = [line for line in err.splitlines() if f"rank {r} (layers {lo}-{hi - 1}) of 2: memory" in line]
        assert len(said) == 1 and "tok/s for its layers" in said[0], err[-3000:]
    plans = sorted((load_plan(p) for p in (tmp_path / "plans").glob("*/plan.json")),
                   key=lambda p: p.share.rank if p.share else -1)
    assert [(p.share.rank, p.share.lo, p.share.hi) for p in plans if p.share] == [(r, *s) for r, s in enumerate(split)]
    for p in plans:
        assert p.share is not None and p.memory_bytes == budget and p.account.total <= budget
        assert p.capacities and all(p.share.holds(ly) for ly in p.capacities)
        assert max(p.capacities.values()) > 4  # more than top-k: the budget is this rank's alone
    assert sorted(ly for p in plans for ly in p.capacities) == list(range(8))
    got = np.load(tmp_path / "out0.npz")
    assert got["mem.plan_layers"].tolist() == sorted(plans[0].capacities)  # rank 0's eng.plan: its own
    for key, want in one_process_stream.items():
        assert got[f"mem.{key}"].dtype == want.dtype and np.array_equal(got[f"mem.{key}"], want), key


def test_a_budget_too_small_for_a_ranks_share_is_refused_on_every_rank(tiny_qn4: Path, tmp_path: Path) -> None:
    split, needs, _ = _needs(tiny_qn4)
    r = int(np.argmax(needs))
    lo, hi = split[r]
    results = _finish(_start(2, tiny_qn4, tmp_path, _scenario(needs[r] - 1, tmp_path / "plans")), timeout_s=120)
    for rank, (rc, err) in enumerate(results):
        assert rc != 0, f"rank {rank} ran"
        assert (f"on rank {r} (layers {lo}-{hi - 1}) of 2: below the smallest budget that fits its share of the "
                f"model" in err and f"({needs[r]} bytes" in err), err[-3000:]
    assert not (tmp_path / "plans").exists()  # refused before any rank planned (or loaded)
