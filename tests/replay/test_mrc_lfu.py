"""LFU's curve (qnpipe.replay.mrc_lfu): at every grid capacity what a demand-only LFU replay counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import config
from qnpipe.replay import replay
from qnpipe.replay.log import load_log
from qnpipe.replay.mrc import ALL
from qnpipe.replay.mrc_lfu import grid, lfu_curves, lfu_hits, lfu_hits_fast
from tests.profiles import examples
from tests.replay.test_mrc import logs, write_log


def _check(path, experts: int, k: int, points: int, decay: int = 0) -> None:  # noqa: ANN001
    log = load_log(path)
    curves = {c.layer: c for c in lfu_curves(log.steps, log.shape, points=points, decay_interval=decay)}
    at = grid(k, experts, points)
    for cap in at:
        cfg = config.load(None, overrides={"pool.expert_slots": str(cap), "pool.evict_policy": "lfu",
                                           "pool.lfu_decay_interval_forwards": str(decay)})
        r = replay(path, cfg, record_nbytes=1024)
        i = cap - k
        total = 0
        for x in r.layers:
            if not x.requests:
                continue
            c = curves[x.layer]
            assert (c.hits[i], c.requests[i]) == (x.hits, x.requests), (cap, x)
            total += x.hits
        assert curves[ALL].hits[i] == total


# fewer: each example replays at every grid capacity
@examples(20)
@given(case=logs())
def test_lfu_curve_is_the_replay_at_every_capacity_when_the_grid_covers_them(case, tmp_path_factory) -> None:  # noqa: ANN001
    """At most GRID capacities: every one replayed, the curve exact everywhere (multi-token steps included)."""
    steps, experts, k = case
    path = write_log(tmp_path_factory.mktemp("lfu") / "log.qtrace", steps, experts=experts, k=k)
    assert grid(k, experts) == list(range(k, experts + 1))
    _check(path, experts, k, points=17)


@examples(10)
@given(case=logs())
def test_lfu_curve_is_the_replay_at_the_grid_points_with_decay(case, tmp_path_factory) -> None:  # noqa: ANN001
    """A coarse grid: the replay at each grid point, counts halved every 2 forwards as the pool halves them."""
    steps, experts, k = case
    path = write_log(tmp_path_factory.mktemp("lfu") / "log.qtrace", steps, experts=experts, k=k)
    _check(path, experts, k, points=3, decay=2)


def test_between_the_grid_points_the_curve_interpolates() -> None:
    assert grid(4, 64, 5) == [4, 19, 34, 49, 64]
    assert grid(4, 8) == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("points", [2, 5])
def test_interpolated_values_lie_between_their_neighbours(points: int, tmp_path) -> None:  # noqa: ANN001
    steps: list[list[tuple[int, ...] | None]] = [[tuple((s * 7 + j * 3) % 32 for j in range(4))] for s in range(200)]
    path = write_log(tmp_path / "log.qtrace", steps, experts=32, k=4)
    log = load_log(path)
    c = next(x for x in lfu_curves(log.steps, log.shape, points=points) if x.layer == 0)
    at = grid(4, 32, points)
    for a, b in zip(at, at[1:], strict=False):
        lo, hi = sorted((c.hits[a - 4], c.hits[b - 4]))
        assert all(lo <= h <= hi for h in c.hits[a - 4:b - 4 + 1])


@st.composite
def layer_seqs(draw: st.DrawFn) -> tuple[list[tuple[int, ...] | None], int, int, int, int]:
    experts = draw(st.integers(4, 12))
    k = draw(st.integers(1, min(3, experts)))
    token = st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True)
    steps = draw(st.lists(st.one_of(st.none(), st.lists(token, min_size=1, max_size=3).map(
        lambda ts: tuple(e for t in ts for e in t))), min_size=1, max_size=40))
    return steps, k, draw(st.integers(k, experts)), draw(st.sampled_from([0, 1, 2, 5])), experts


@examples(200)
@given(case=layer_seqs())
def test_the_fast_lfu_is_the_slot_tables(case: tuple[list[tuple[int, ...] | None], int, int, int, int]) -> None:
    steps, k, cap, decay, _ = case
    assert lfu_hits_fast(steps, k, cap, decay_interval=decay) == lfu_hits(steps, k, cap, decay_interval=decay)


def test_the_fast_lfu_is_the_slot_tables_over_a_long_skewed_log() -> None:
    """Long enough that the heap's stale entries are dropped many times over, counts halved or not."""
    import random

    rng = random.Random(7)
    steps: list[tuple[int, ...] | None] = []
    for _ in range(600):
        tokens = rng.choice([1, 1, 1, 4])
        flat: list[int] = []
        for _ in range(tokens):
            flat += rng.sample(range(48), 4) if rng.random() < 0.3 else rng.sample(range(12), 4)
        steps.append(tuple(flat) if rng.random() < 0.95 else None)
    for cap in (4, 7, 13, 30, 48):
        for decay in (0, 3):
            assert lfu_hits_fast(steps, 4, cap, decay_interval=decay) == lfu_hits(steps, 4, cap, decay_interval=decay)
