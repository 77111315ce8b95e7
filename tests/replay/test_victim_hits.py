"""Prefetch credit only for prefetch reads: with pool.prefetch_into=main the side region keeps what the resident
slots gave up (a victim cache), and its hits are counted under their own name, never as prefetched in time.

Three shapes where no predictor can issue a read (a prefetch-off run, `previous` on one-token steps, any
predictor on a one-layer log) report 0 prefetch hits; with no prefetch read the pool is a demand cache of
resident + side slots, so Belady at that memory is never below a layer's hit rate (a property test).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from route_logs import NBYTES, SHAPE, write_log

from qnpipe import config, trace
from qnpipe.replay import describe, replay
from qnpipe.replay.export import write_csv
from qnpipe.replay.report import metric_names


def _cfg(**over: object) -> config.Config:
    return config.load(None, env={}, overrides={"pool.expert_slots": 2, "pool.side_region_slots": 3,
                                                "pool.prefetch_into": "main", **over})


def _zero_prefetch_hits(r: object) -> None:
    from qnpipe.replay import ReplayReport

    assert isinstance(r, ReplayReport)
    assert r.prefetch_hit_rate == 0.0
    assert all(x.prefetch_hits == 0 for x in r.layers)
    assert r.side_hit_rate == r.victim_hit_rate
    assert all(x.side_hits == x.victim_hits for x in r.layers)
    assert r.hit_rate == pytest.approx(r.resident_hit_rate + r.prefetch_hit_rate + r.victim_hit_rate)


def test_a_prefetch_off_run_has_no_prefetch_hit_and_no_side_region(tmp_path: Path) -> None:
    r = replay(write_log(tmp_path / "r.qtrace"), _cfg(), record_nbytes=NBYTES)
    _zero_prefetch_hits(r)
    assert r.side_slots == 0 and r.victim_hit_rate == 0.0 and r.prefetch is None
    assert "(lfu eviction, prefetch off)" in describe(r)
    assert "prefetched in time" not in describe(r)


def test_previous_on_one_token_steps_reads_nothing_and_its_side_hits_are_the_victim_regions(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace", steps=60)  # one token per step
    r = replay(log, _cfg(), record_nbytes=NBYTES, predictor="previous")
    assert r.prefetch is not None and r.prefetch.reads == 0 and r.prefetch.issued == 0
    _zero_prefetch_hits(r)
    assert r.victim_hit_rate > 0  # the side region kept what the two resident slots gave up
    assert any("issued no prefetch read" in w and "one token" in w for w in r.warnings)
    text = describe(r)
    assert "prefetched in time 0.000 + victim region" in text
    assert "victim" in text.split("\n")[-len(r.layers) - 1]  # the table's own column
    assert "at resident + side (the same memory)" in text


def test_any_predictor_on_a_one_layer_log_reads_nothing(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace", layers=(2,), steps=60)
    for predictor in ("oracle", "previous"):
        r = replay(log, _cfg(), record_nbytes=NBYTES, predictor=predictor)
        assert r.prefetch is not None and r.prefetch.reads == 0
        _zero_prefetch_hits(r)
        assert r.victim_hit_rate > 0
        assert any("one MoE layer" in w for w in r.warnings), r.warnings


def test_prefetch_reads_that_land_are_prefetch_hits_not_victim_hits(tmp_path: Path) -> None:
    log = write_log(tmp_path / "r.qtrace", steps=60)
    r = replay(log, _cfg(), record_nbytes=NBYTES, predictor="oracle")
    assert r.prefetch is not None and r.prefetch.reads > 0
    assert r.prefetch_hit_rate > 0
    assert not any("issued no prefetch read" in w for w in r.warnings)
    assert sum(x.prefetch_hits + x.victim_hits for x in r.layers) == sum(x.side_hits for x in r.layers)
    # side placement: the side region holds prefetches only, so no hit there is a victim's
    s = replay(log, _cfg(**{"pool.prefetch_into": "side"}), record_nbytes=NBYTES, predictor="oracle")
    assert s.victim_hit_rate == 0.0 and all(x.victim_hits == 0 for x in s.layers)


def test_victim_hits_are_their_own_metric_in_the_csv_and_for_figures(tmp_path: Path) -> None:
    r = replay(write_log(tmp_path / "r.qtrace", steps=60), _cfg(), record_nbytes=NBYTES, predictor="previous")
    assert {"victim_hit_rate", "prefetch_hit_rate", "belady_same_memory_hit_rate"} <= set(metric_names())
    out = tmp_path / "r.csv"
    write_csv(r.rows(), out)
    with out.open() as f:
        rows = list(csv.DictReader(f))
    got = {(row["layer"], row["metric"]): float(row["value"]) for row in rows}
    assert got[("all", "victim_hit_rate")] == r.victim_hit_rate > 0
    assert got[("all", "prefetch_hit_rate")] == 0.0
    layer = r.layers[0].layer
    assert got[(str(layer), "victim_hits")] == r.layers[0].victim_hits
    assert got[(str(layer), "prefetch_hits")] == 0.0


def _random_log(path: Path, layers: tuple[int, ...], steps: list[list[int]], k: int) -> Path:
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=SHAPE,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes"))
    seq = 0
    for i, experts in enumerate(steps, start=1):
        for layer in layers:
            w.write(trace.Route(t=0.0, seq=seq, step=i, layer=layer, top_k=k, experts=tuple(experts)))
            seq += 1
    w.close(0, 0.0)
    return path


@settings(max_examples=25, deadline=None)
@given(data=st.data(), policy=st.sampled_from(["lru", "lfu", "fifo", "clock", "sieve"]),
       resident=st.integers(2, 5), side=st.integers(1, 6), predictor=st.sampled_from(["previous", "oracle"]),
       one_layer=st.booleans())
def test_without_a_prefetch_read_belady_at_the_same_memory_bounds_every_layer(
        data: st.DataObject, policy: str, resident: int, side: int, predictor: str, one_layer: bool,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    rng = random.Random(data.draw(st.integers(0, 10**6), label="seed"))
    hot = data.draw(st.integers(3, 16), label="hot")
    tokens = data.draw(st.integers(1, 3), label="tokens per step")
    steps = [[e for _ in range(tokens) for e in rng.sample(range(hot), 2)] for _ in range(rng.randint(10, 60))]
    layers = (1,) if one_layer else (0, 1)
    log = _random_log(tmp_path_factory.mktemp("prop") / "r.qtrace", layers, steps, 2)
    r = replay(log, _cfg(**{"pool.expert_slots": resident, "pool.side_region_slots": side,
                            "pool.evict_policy": policy}), record_nbytes=NBYTES, predictor=predictor)
    assert r.prefetch is not None
    assume(r.prefetch.reads == 0)
    _zero_prefetch_hits(r)
    for x in r.layers:
        assert x.hit_rate <= x.belady_same_memory_hit_rate + 1e-12, (x, policy, resident, side)
    assert r.hit_rate <= r.belady_same_memory_hit_rate + 1e-12
