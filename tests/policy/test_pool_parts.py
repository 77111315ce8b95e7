"""PoolPolicy's parts and answers (qnpipe/policy/pool.py and the modules it composes).

Each call answers with all that follows from it: the reads, the grants, the reads landed for early
grants, the promotions and the recall samples come in the frozen result, none is left in the policy
to collect. And the policy's modules stay small: none in qnpipe/policy/ over POLICY_MAX_LINES.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.config import EvictPolicy
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.placement import MainPlacement, SidePlacement
from qnpipe.policy.pool import AcquireResult, PoolOptions, PoolPolicy, ReadResult

POLICY = Path(__file__).resolve().parents[2] / "qnpipe" / "policy"
POLICY_MAX_LINES = 400


def _over(root: Path, limit: int) -> list[str]:
    """The modules under `root` longer than `limit` lines, with their length."""
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


def test_no_policy_module_is_over_the_limit() -> None:
    assert _over(POLICY, POLICY_MAX_LINES) == []


def test_no_module_of_qnpipe_is_over_500_lines() -> None:
    assert _over(POLICY.parent, 500) == []


def test_the_size_rule_names_a_module_over_the_limit(tmp_path: Path) -> None:
    (tmp_path / "small.py").write_text("x = 1\n" * POLICY_MAX_LINES)
    (tmp_path / "big.py").write_text("x = 1\n" * (POLICY_MAX_LINES + 1))
    assert _over(tmp_path, POLICY_MAX_LINES) == [f"big.py: {POLICY_MAX_LINES + 1} lines"]


def _policy(**options: object) -> PoolPolicy:
    return PoolPolicy.build({0: 2, 1: 2}, {ly: make_eviction(EvictPolicy.LRU, 2) for ly in (0, 1)}, {0: 8, 1: 8},
                            PoolOptions(**options))  # type: ignore[arg-type]


@pytest.mark.parametrize("into_main", [False, True])
def test_acquire_and_read_done_answer_with_promotions_landed_reads_and_recall(into_main: bool) -> None:
    p = _policy(predicting=True, side_slots=1, into_main=into_main, recall_prof=True)
    assert isinstance(p.placement, MainPlacement if into_main else SidePlacement)
    [pre] = p.prefetch(1, -1, 0, [(1, 1.0)])
    acq = p.acquire((1, 0, 0), [1, 2], 1.0)  # 1: its prefetch still on the way; 2: a miss
    [ld] = acq.loads
    assert ld.expert == 2 and acq.ready is None
    assert acq.promotions == ((0, 1, pre.slot),)  # the step now waits for the prefetch: read it as demand
    assert acq.recall == ((0, 2, 1),)  # (layer, used, predicted)
    first = p.read_done(0, 2, ld.slot)
    assert first == ReadResult(landed=(((1, 0, 0), 2, ld.slot),))  # an early grant's step may start on 2
    last = p.read_done(0, 1, pre.slot)
    assert [g.key for g in last.grants] == [(1, 0, 0)] and not last.landed and not last.loads
    with pytest.raises(AttributeError):  # the answer is a value: frozen
        acq.loads = ()  # type: ignore[misc]


def test_a_deferred_acquire_taken_up_gives_its_recall_sample_with_the_next_acquire() -> None:
    """As the event log always had it: the samples of acquires taken up again by a read come with the next acquire."""
    p = _policy(predicting=True, recall_prof=True)
    first = p.acquire((1, 1, 0), [3, 4], 1.0)
    assert first.recall == ((1, 2, 0),)
    loads = first.loads
    p.release((1, 1, 0))  # cancelled: its reads still in flight
    assert p.acquire((2, 1, 0), [5], 2.0) == AcquireResult()  # deferred: no sample yet
    taken_up = p.read_done(1, loads[0].expert, loads[0].slot)
    assert [ld.expert for ld in taken_up.loads] == [5] and not taken_up.grants
    assert p.acquire((3, 0, 0), [7], 3.0).recall == ((1, 1, 0), (0, 1, 0))


def test_without_recall_prof_no_sample_is_kept() -> None:
    p = _policy(predicting=True)
    assert p.acquire((1, 0, 0), [1], 1.0).recall == ()


def _lfu_policy(**options: object) -> PoolPolicy:
    return PoolPolicy.build({0: 3}, {0: make_eviction(EvictPolicy.LFU, 3)}, {0: 8},
                            PoolOptions(**options))  # type: ignore[arg-type]


def test_an_acquires_reads_come_out_before_its_grant_and_counters_and_change_nothing_else() -> None:
    """`PoolPolicy.acquire`'s `reads_now`: the same reads as the result's, before the misses are counted; the
    results, the tables and the counters of a run with it are those of the same run without."""
    steps = [[1, 2], [2, 3], [4, 5], [1, 5], [6, 1], [2, 6]]
    runs = []
    for hooked in (True, False):
        p = _lfu_policy()
        early: list[tuple[int, ...]] = []

        def reads_now(loads: object, p: PoolPolicy = p, early: list[tuple[int, ...]] = early) -> None:
            early.append(tuple(ld.expert for ld in loads))  # type: ignore[attr-defined]
            assert p.counters[0].misses == sum(map(len, early[:-1]))  # called before this acquire is counted

        results = []
        for step, experts in enumerate(steps):
            acq = p.acquire((step, 0, 0), experts, float(step), reads_now if hooked else None)
            results.append(acq)
            for ld in acq.loads:
                results.append(p.read_done(0, ld.expert, ld.slot))
            p.release((step, 0, 0))
            p.forward_done()
        if hooked:
            assert early == [tuple(ld.expert for ld in r.loads) for r in results
                             if isinstance(r, AcquireResult) and r.loads]
            assert len(early) >= 4
        runs.append((results, p.statistics(), dict(p.tables[0].slot_of)))
    assert runs[0] == runs[1]


def test_an_acquire_with_a_side_region_gives_its_reads_with_the_result_only() -> None:
    p = _policy(predicting=True, side_slots=1)
    p.prefetch(1, -1, 0, [(1, 1.0)])
    got: list[object] = []
    acq = p.acquire((1, 0, 0), [1, 2], 1.0, got.append)  # 1 is in the side region: a promotion may follow
    assert got == [] and [ld.expert for ld in acq.loads] == [2]
