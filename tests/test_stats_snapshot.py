"""Statistics as snapshots: `Pipeline.statistics()` and the one pure function that makes the public figures.

The engine's public `PoolStats` used to be re-mapped by hand from the live counters of four
actors; `OLD_MAPPING` below is that code, kept as the reference: under every setting the
public figures made of the snapshot are the ones it made, field for field and byte for byte.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import msgspec
import pytest
import trio
import trio.testing

import qnpipe
from qnpipe.io.reader import ReaderStats
from qnpipe.io.sim_model import DeviceProfile, SimStatistics
from qnpipe.io.simssd import open_simssd
from qnpipe.policy.pool import LayerCounters, PoolStatistics
from qnpipe.policy.read_queue import Job, ReadClass
from qnpipe.stats import EngineStats, LayerPoolStats, PoolStats, UnionProf
from qnpipe.stats_snapshot import (
    ForwardStatistics,
    LayerTable,
    PipelineStatistics,
    PredictorStatistics,
    ReadStatistics,
    engine_stats,
    pool_stats,
)

PROMPT = [5, 17, 300, 42, 9, 77, 11, 12, 13]


def old_mapping(rt: Any) -> EngineStats:
    """The engine's stats as engine.py made them before the snapshot (verbatim but for the names)."""
    totals = rt.totals
    if rt.prefix.enabled:
        totals = msgspec.structs.replace(totals, prefix=rt.prefix.current_stats())
    pol = rt.pipe.policy
    if pol is None:
        return totals
    fs = rt.pipe.forward.stats
    rs = rt.pipe.read_stats
    ps = rt.pipe.predictor_stats
    queue = rt.pipe.read_queue  # merged reads and the peak: the scheduler's copies of them are gone
    assert rs is not None and queue is not None
    pst = pol.statistics()
    counters, hits, misses, by_cause = pst.layers, pst.hits, pst.misses, pst.causes
    st = rt.core.streaming
    layers = tuple(LayerPoolStats(layer=layer, capacity=t.capacity, occupancy=t.occupancy,
                                  hits=counters[layer].hits, misses=counters[layer].misses,
                                  evictions=counters[layer].evictions,
                                  prefetch_recall=counters[layer].predicted_used / counters[layer].used
                                  if pol.predicting and counters[layer].used else 0.0)
                   for layer, t in sorted(pol.tables.items()))
    pool = PoolStats(hits=hits, misses=misses, misses_by_cause=by_cause,
                     hit_rate=hits / (hits + misses) if hits + misses else 0.0, reads=rs.reads,
                     bytes_read=rs.bytes_read, merged_reads=queue.merged, peak_reads_in_flight=queue.peak_in_flight,
                     device_s=rs.device_s, stall_s=fs.stall_s, steps=fs.steps, layer_steps=fs.layer_steps,
                     split_layer_steps=fs.split_layer_steps, early_grants=fs.early_grants,
                     slot_bytes=sum(s.nbytes for s in st.slots.values()) if st is not None else 0,
                     layers=layers, pinned=sum(len(t.pinned) for t in pol.tables.values()),
                     side_hits=pst.side_hits, prefetch_hits=pst.prefetch_hits, victim_hits=pst.victim_hits,
                     prefetch_issued=pst.prefetches_issued, prefetch_done=pst.prefetches_done,
                     prefetch_used=pst.prefetches_used, prefetch_expired=pst.prefetches_expired,
                     useful_prefetch_ratio=pst.prefetches_used / pst.prefetches_issued
                     if pst.prefetches_issued else 0.0,
                     prefetch_recall=pst.recall,
                     wasted_bytes=pst.wasted_bytes,
                     hints=ps.hints if ps is not None else 0,
                     hints_dropped_full=ps.hints_dropped_full if ps is not None else 0,
                     hints_dropped_budget=pst.hints_dropped_budget, candidates_dropped=fs.candidates_dropped,
                     stall_s_by_layer=dict(fs.stall_by_layer),
                     union_prof=tuple(UnionProf(tokens=n, layer=ly, layer_steps=c, mean_union=s / c, max_union=mx)
                                      for (n, ly), (c, s, mx) in sorted(fs.union_sizes.items())))
    return msgspec.structs.replace(totals, expert_bytes_read=rs.bytes_read,
                                   expert_misses_by_cause=by_cause, pool=pool)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("snap") / "tiny-fp32"
    convert(tiny_hf, out)
    return out


SETTINGS: list[dict[str, Any]] = [
    {"pool.autopin": False},
    # prediction and prefetch into a side region, union profiles, route verification
    {"pool.autopin": False, "predict.cross_layer_prefetch": True, "pool.side_region_slots": 8,
     "diag.union_prof": True, "diag.route_verify": True},
    # prefetches into the resident region; early grants off
    {"pool.autopin": False, "predict.cross_layer_prefetch": True, "pool.prefetch_into": "main",
     "forward.early_grants": False},
    # autopin: the second engine starts with the first one's hottest experts pinned
    {"pool.autopin": True, "pool.autopin_save_every_forwards": 2},
]


@pytest.mark.parametrize("over", SETTINGS, ids=["plain", "side", "main", "autopin"])
def test_public_figures_are_the_old_mapping(streamed: Path, tmp_path: Path, over: dict[str, Any]) -> None:
    over = {**over, "pool.autopin_usage_file": str(tmp_path / "heat.json")}

    async def run() -> list[tuple[EngineStats, EngineStats, PipelineStatistics]]:
        out = []
        for _ in range(2 if over["pool.autopin"] else 1):
            async with qnpipe.open_engine(streamed, expert_slots=6, **over) as eng:
                for n in (9, 3):
                    await eng.generate(PROMPT, max_tokens=n, stop_at_eos=False)
                    # Together, with no checkpoint between them: the same moment of the pipeline.
                    out.append((eng.stats(), old_mapping(eng._rt), eng._rt.pipe.statistics()))
        return out

    got = trio.run(run)
    for new, old, snap in got:
        assert new == old
        assert msgspec.json.encode(new) == msgspec.json.encode(old)
        assert new.pool is not None and new.pool.misses > 0 and new.pool.reads > 0
        # Each figure from one source: the read scheduler's reads and bytes, the pool's hits.
        assert snap.reads is not None and snap.pool is not None
        assert (new.pool.reads, new.pool.bytes_read) == (snap.reads.reads, snap.reads.bytes_read)
        assert new.expert_bytes_read == snap.reads.bytes_read and new.pool.hits == snap.pool.hits
        assert isinstance(snap.device, ReaderStats) and snap.device.bytes_read > 0
    first, second = got[0][2], got[1][2]
    assert second.forward.steps > first.forward.steps  # the first snapshot did not move with the pipeline
    assert second.pool is not None and first.pool is not None and second.pool.requests > first.pool.requests
    if over.get("predict.cross_layer_prefetch"):
        assert got[-1][0].pool is not None and got[-1][0].pool.hints > 0
    if over.get("diag.union_prof"):
        assert got[-1][0].pool is not None and got[-1][0].pool.union_prof
    if over["pool.autopin"]:
        assert got[-1][0].pool is not None and got[-1][0].pool.pinned > 0


def test_all_resident_has_no_pool_figures(streamed: Path) -> None:
    async def run() -> tuple[EngineStats, EngineStats, PipelineStatistics]:
        async with qnpipe.open_engine(streamed, eager_load=True) as eng:
            await eng.generate(PROMPT, max_tokens=3, stop_at_eos=False)
            return eng.stats(), old_mapping(eng._rt), eng._rt.pipe.statistics()

    new, old, snap = trio.run(run)
    assert new == old and new.pool is None and new.expert_source == "resident"
    assert snap.pool is None and snap.reads is None and snap.tables == () and snap.device is None
    assert pool_stats(snap) is None


def _snapshot() -> PipelineStatistics:
    """Every figure a different number, so a field mapped from the wrong source shows."""
    c0 = LayerCounters(hits=3, side_hits=1, misses=2, evictions=1, used=5, predicted_used=2)
    c1 = LayerCounters(hits=4, misses=6, evictions=3, used=10, predicted_used=5)
    pool = PoolStatistics(layers={0: c0, 2: c1}, hits=7, misses=8, side_hits=31, used=15, predicted_used=7,
                          prefetch_reads=9, prefetch_used=4, causes={"cold": 5, "late": 3}, prefetches_issued=12,
                          prefetches_done=9, prefetches_used=4, prefetches_expired=2, hints_dropped_budget=13,
                          wasted_bytes=1400, victim_hits=11)
    return PipelineStatistics(
        forward=ForwardStatistics(steps=21, layer_steps=42, split_layer_steps=1, early_grants=17,
                                  stall_s=0.25, stall_by_layer={0: 0.125, 2: 0.125}, candidates_dropped=19,
                                  union_sizes={(1, 2): (4, 10, 3), (1, 0): (2, 6, 4)}),
        pool=pool, predicting=True,
        tables=(LayerTable(layer=0, capacity=6, occupancy=5, pinned=2), LayerTable(layer=2, capacity=8,
                                                                                  occupancy=8, pinned=1)),
        reads=ReadStatistics(requests=30, merged=23, batches=11, reads=24, bytes_read=2400, device_s=0.5,
                             peak_in_flight=25, promoted=26, expired=27),
        predictor=PredictorStatistics(candidates=40, hints=28, hints_dropped_full=29, experts_hinted=50))


def test_pool_stats_maps_each_figure_from_its_one_source() -> None:
    p = pool_stats(_snapshot(), slot_bytes=4096)
    assert p is not None
    assert p == PoolStats(
        hits=7, misses=8, misses_by_cause={"cold": 5, "late": 3}, hit_rate=7 / 15, reads=24, bytes_read=2400,
        merged_reads=23, peak_reads_in_flight=25, device_s=0.5, stall_s=0.25, steps=21, layer_steps=42,
        split_layer_steps=1, early_grants=17, slot_bytes=4096,
        layers=(LayerPoolStats(layer=0, capacity=6, occupancy=5, hits=3, misses=2, evictions=1, prefetch_recall=0.4),
                LayerPoolStats(layer=2, capacity=8, occupancy=8, hits=4, misses=6, evictions=3, prefetch_recall=0.5)),
        pinned=3, side_hits=31, prefetch_hits=20, victim_hits=11, prefetch_issued=12, prefetch_done=9, prefetch_used=4, prefetch_expired=2,
        useful_prefetch_ratio=4 / 12, prefetch_recall=7 / 15, wasted_bytes=1400, hints=28, hints_dropped_full=29,
        hints_dropped_budget=13, candidates_dropped=19, stall_s_by_layer={0: 0.125, 2: 0.125},
        union_prof=(UnionProf(tokens=1, layer=0, layer_steps=2, mean_union=3.0, max_union=4),
                    UnionProf(tokens=1, layer=2, layer_steps=4, mean_union=2.5, max_union=3)))
    # A field added to PoolStats and left at its default by pool_stats shows here.
    assert unset_fields(p) == []
    assert unset_fields(msgspec.structs.replace(p, hints=0, layers=())) == ["layers", "hints"]
    e = engine_stats(EngineStats(requests=2, expert_source="pool"), _snapshot(), slot_bytes=4096)
    assert e.pool == p and e.expert_bytes_read == 2400 and e.expert_misses_by_cause == {"cold": 5, "late": 3}
    assert e.requests == 2
    # Without prediction a layer's recall is 0, and an empty pipeline divides by nothing.
    quiet = attrs.evolve(_snapshot(), predicting=False, predictor=None)
    q = pool_stats(quiet)
    assert q is not None and {ly.prefetch_recall for ly in q.layers} == {0.0} and q.hints == 0
    assert q.hints_dropped_full == 0 and q.slot_bytes == 0


def unset_fields(p: PoolStats) -> list[str]:
    """The fields of `p` still at their default."""
    out = []
    for f in msgspec.structs.fields(p):
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        if getattr(p, f.name) == default:
            out.append(f.name)
    return out


def mutable_classes(module: Any) -> list[str]:
    """The attrs classes `module` defines that are not frozen."""
    return [name for name, cls in vars(module).items()
            if isinstance(cls, type) and cls.__module__ == module.__name__ and attrs.has(cls)
            and getattr(cls.__setattr__, "__name__", "") != "_frozen_setattrs"]


def test_snapshots_are_frozen() -> None:
    import types

    from qnpipe import stats_snapshot

    assert mutable_classes(stats_snapshot) == []
    made_up = types.ModuleType("made_up")

    @attrs.define
    class Live:
        n: int = 0

    Live.__module__ = "made_up"
    made_up.Live = Live  # type: ignore[attr-defined]
    assert mutable_classes(made_up) == ["Live"]
    snap = _snapshot()
    for obj, field in ((snap, "predicting"), (snap.forward, "steps"), (snap.reads, "reads"),
                       (snap.predictor, "hints"), (snap.tables[0], "occupancy")):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(obj, field, 0)


def test_simulated_device_statistics_is_a_detached_snapshot() -> None:
    profile = DeviceProfile(bandwidth_bytes_per_s=1e6, latency_s=0.001, queue_depth=2)

    async def run() -> tuple[SimStatistics, SimStatistics, SimStatistics]:
        async with open_simssd(profile, {0: 1000, 1: 3000}) as dev:
            empty = dev.statistics()
            await dev.read([Job(0, 1, 0, ReadClass.DEMAND), Job(1, 2, 0, ReadClass.DEMAND)])
            one = dev.statistics()
            await dev.read([Job(0, 3, 1, ReadClass.DEMAND)])
            return empty, one, dev.statistics()

    empty, one, two = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (empty.reads, empty.bytes_read) == (0, 0)
    assert (one.reads, one.bytes_read) == (2, 4000) and one.busy_s > 0 and one.service_s > 0
    assert (two.reads, two.bytes_read) == (3, 5000)
    assert one.peak_in_service == 2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        one.reads = 0  # type: ignore[misc]


def test_the_read_queue_counts_merges_and_the_peak_as_the_read_scheduler_did() -> None:
    """`Pipeline.statistics()` takes merged reads and the peak in flight from the queue, once counted twice."""
    import random

    from qnpipe.messages import ReadExperts
    from qnpipe.policy.read_core import BatchDone, ReadCore
    from qnpipe.policy.read_queue import ReadQueue

    rng = random.Random(5)
    core = ReadCore(ReadQueue(3, batch=True, max_prefetch_in_flight=2))
    on_device: list[Any] = []
    for t in range(300):
        if rng.random() < 0.6:
            experts = tuple(rng.sample(range(8), rng.randint(1, 3)))
            cls = rng.choice([ReadClass.DEMAND, ReadClass.PREFETCH])
            core.handle(ReadExperts(t=t, seq=t, layer=0, experts=experts, slots=experts, cls=cls,
                                    deadline=t + 5.0 if cls is ReadClass.PREFETCH else math.inf,
                                    scores=(1.0,) * len(experts) if cls is ReadClass.PREFETCH else ()), t)
        on_device += core.end_turn(t).batches
        if on_device and rng.random() < 0.5:
            b = on_device.pop(rng.randrange(len(on_device)))
            core.handle(BatchDone(b, (100,) * len(b.jobs)), t)
            on_device += core.end_turn(t).batches
        snap = core.statistics()  # the one count, the queue's (tests/policy/test_read_queue.py checks it)
        assert (snap.merged, snap.peak_in_flight) == (core.queue.merged, core.queue.peak_in_flight)
    assert core.queue.merged > 0 and core.queue.peak_in_flight == 3
