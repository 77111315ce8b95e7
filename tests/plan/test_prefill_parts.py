"""The allocation counts prefill parts: a capacity below a chunk's union pays for the passes it splits into."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.io.sim_model import PROFILES
from qnpipe.plan.fixed import Fixed
from qnpipe.plan.prefill_parts import chunks, extra_parts, layer_extra_parts
from qnpipe.plan.search import Search
from qnpipe.replay.log import load_log
from qnpipe.replay.runner import CostModel
from tests.replay.test_mrc import write_log


def _log(path: Path) -> Path:
    """Layer 0: a prefill chunk of two tokens over 4 experts, then decode on 2 others (its misses are the
    same at 2..5 slots: each chunk evicts the decode pair whatever fits). Layer 1: decode over 3 pairs in
    turn (LRU thrashes below 6 slots)."""
    steps: list[list[tuple[int, ...] | None]] = []
    for _ in range(20):
        steps.append([(4, 5, 6, 7), (0, 1)])
        for pair in [(0, 1), (2, 3), (4, 5)] * 3:
            steps.append([(0, 1), pair])
    return write_log(path, steps, experts=8, k=2)


def _search(log: Path, *, prefill: bool, record_nbytes: int, chunk: int = 2) -> Search:
    cfg = config.load(None, overrides={"forward.prefill_chunk_tokens": str(chunk)})
    return Search(log, cfg, device=PROFILES["apple-m5-internal"], cost=CostModel(), record_nbytes=record_nbytes,
                  fixed=Fixed(policy="lru"), prefill=prefill)


def test_counting_prefill_parts_keeps_the_chunk_whole(tmp_path: Path) -> None:
    """Small experts (a miss ~5 us, a layer pass 2 ms): 9 slots go 4 + 5, not 2-3 + 6, once a split chunk pays."""
    log = _log(tmp_path / "log.qtrace")
    with_parts = _search(log, prefill=True, record_nbytes=1024)
    without = _search(log, prefill=False, record_nbytes=1024)
    assert with_parts.parts_source == "log"
    assert with_parts.parts[0][:4] == [20, 20, 0, 0]  # one extra pass per chunk at 2 and 3 slots
    assert without.planned(9)[1] == 6 and without.planned(9)[0] < 4
    assert with_parts.planned(9) == {0: 4, 1: 5}
    assert with_parts.prefill_parts(with_parts.planned(9)) == 0 < with_parts.prefill_parts(without.planned(9))


def test_counting_prefill_parts_changes_nothing_where_misses_cost_more(tmp_path: Path) -> None:
    """64 MB experts (a miss ~9 ms): layer 1's misses outweigh layer 0's split chunks, the same allocation."""
    log = _log(tmp_path / "log.qtrace")
    with_parts = _search(log, prefill=True, record_nbytes=64 << 20)
    without = _search(log, prefill=False, record_nbytes=64 << 20)
    for total in range(4, 17):
        assert with_parts.planned(total) == without.planned(total), total


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_decode_log_derives_its_chunks_from_the_configured_size(tmp_path: Path, chunk: int) -> None:
    steps: list[list[tuple[int, ...] | None]] = [[(s % 8, (s + 3) % 8)] for s in range(12)]
    log = load_log(write_log(tmp_path / "log.qtrace", steps, experts=8, k=2))
    per, source = chunks(log.steps, log.shape, chunk)
    assert source == "derived"
    parts, _ = layer_extra_parts(log.steps, log.shape, chunk)
    if chunk == 1:  # a chunk of one token is one token's experts: never split
        assert per[0] == [] and parts[0] == [0] * 7
    else:
        assert [len(c) for c in per[0]] == [6] * 4 and parts[0][0] == 4 * 2  # 3 tokens at 2 slots: 3 passes
        assert parts[0][6 - 2:] == [0, 0, 0]
    # with no chunk that splits, the allocation is the misses' alone (values scaled by one constant)
    if chunk == 1:
        cfg_log = write_log(tmp_path / "log1.qtrace", steps, experts=8, k=2)
        a, b = (_search(cfg_log, prefill=p, record_nbytes=1024, chunk=1) for p in (True, False))
        assert all(a.planned(t) == b.planned(t) for t in range(2, 9))


def test_extra_parts_are_the_greedy_split() -> None:
    assert extra_parts([(0, 1, 2, 3, 4, 5)], 2, 6, by_expert=False) == [2, 2, 1, 1, 0]  # whole tokens: 3 slots hold one
    # expert-major (the default): as few parts as the slots allow, 3 slots hold half the experts
    assert extra_parts([(0, 1, 2, 3, 4, 5)], 2, 6) == [2, 1, 1, 1, 0]


def test_lfu_is_planned_on_its_own_curve_which_is_the_candidates_replay(tmp_path: Path) -> None:
    """The LFU candidate's slots come from LFU's curve over the timing window, and its replayed hits are that
    curve's at those slots (64 capacities of a layer: a grid of 17 replayed, the rest interpolated)."""
    from qnpipe.replay.mrc_lfu import grid
    from qnpipe.replay.synth import SynthSpec, write_synth

    log = write_synth(tmp_path / "s.qtrace", SynthSpec(layers=4, experts=64, top_k=4, tokens=200, seed=5,
                                                        locality=0.2, popularity="zipf:1.2"))
    s = Search(log, config.load(None), device=PROFILES["apple-m5-internal"], cost=CostModel(), record_nbytes=1 << 20,
               window_layer_steps=4 * 120, work_dir=tmp_path)
    assert s.first == 80 and set(s.allocs) == {"lru", "lfu"}
    curves = s.policy_curves["lfu"]

    def curve_rate(caps: dict[int, int]) -> float:
        at = [caps[ly] - 4 for ly in s.routed]
        return (sum(c.hits[i] for c, i in zip(curves, at, strict=True))
                / sum(c.requests[i] for c, i in zip(curves, at, strict=True)))

    for g in grid(4, 64)[::5]:  # at grid points: the replay's own count
        caps = dict.fromkeys(s.routed, g)
        assert s.run("lfu", "uniform", caps, "lfu", False).report.hit_rate == curve_rate(caps), g
    caps = s.planned(40, "lfu")
    assert abs(s.run("planned lfu", "planned", caps, "lfu", False).report.hit_rate - curve_rate(caps)) < 0.05
    _, tried = s.choose(40)
    by = {c.candidate.name: c for c in tried}
    assert by["planned lfu"].capacities == s.planned(40, "lfu") and by["planned lru"].capacities == s.planned(40)


def test_extra_parts_take_every_capacity_from_a_few_splits() -> None:
    """The count at each capacity is the greedy split's (the ranges between equal ends are filled, not split)."""
    import random

    from qnpipe.policy.parts import Splitter, plan_parts_flat

    rng = random.Random(3)
    for _ in range(30):
        k, e = rng.randint(1, 4), rng.randint(6, 40)
        flat = tuple(x for _ in range(rng.randint(1, 12)) for x in rng.sample(range(e), k))
        want = [len(plan_parts_flat(flat, k, c)) - 1 for c in range(k, e + 1)]
        assert extra_parts([flat], k, e, by_expert=False) == want
        assert extra_parts([flat], k, e) == [len(Splitter(True).parts(flat, k, c)) - 1 for c in range(k, e + 1)]
    for _ in range(30):  # chunks of two tokens: the shortcut
        k, e = rng.randint(1, 4), rng.randint(6, 40)
        flat = tuple(x for _ in range(2) for x in rng.sample(range(e), k))
        assert extra_parts([flat], k, e, by_expert=False) == [len(plan_parts_flat(flat, k, c)) - 1
                                                              for c in range(k, e + 1)]
        assert extra_parts([flat], k, e) == [len(Splitter(True).parts(flat, k, c)) - 1 for c in range(k, e + 1)]
