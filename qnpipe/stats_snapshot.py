"""The pipeline's figures as one frozen snapshot (`Pipeline.statistics()`, qnpipe.actors.pipeline).

Each figure is copied from the one actor that counts it: hits, misses and prefetches from the
pool policy, reads and bytes from the read scheduler (the records the device gave back),
stalls and steps from the forward, hints from the predictor. `pool_stats` and
`engine_stats` make the public `PoolStats` and `EngineStats` (qnpipe.stats) of it: a pure
mapping with no counter of its own, so the engine's stats, the server's metrics and `--stats`
read the same figures. No trio, no MLX: a layer above the policies, below the actors.
"""

from __future__ import annotations

import attrs
import msgspec

from qnpipe.io.reader import ReaderStats
from qnpipe.io.sim_model import SimStatistics
from qnpipe.policy.forward_core import ForwardStatistics
from qnpipe.policy.hinter import PredictorStatistics
from qnpipe.policy.pool import PoolStatistics
from qnpipe.policy.read_core import ReadSchedulerSnapshot as ReadStatistics
from qnpipe.stats import EngineStats, LayerPoolStats, PoolStats, UnionProf


@attrs.frozen(kw_only=True)
class LayerTable:
    """One MoE layer's resident slot table now."""

    layer: int
    capacity: int
    occupancy: int
    pinned: int


@attrs.frozen(kw_only=True)
class PipelineStatistics:
    """Every figure of a running pipeline at one moment; the streaming parts are None when every expert is resident."""

    forward: ForwardStatistics
    pool: PoolStatistics | None = None
    tables: tuple[LayerTable, ...] = ()  # by layer
    predicting: bool = False
    reads: ReadStatistics | None = None
    predictor: PredictorStatistics | None = None
    device: ReaderStats | SimStatistics | None = None  # the device's own (qnpipe.io.device.DeviceStatistics)


def pool_stats(snap: PipelineStatistics, *, slot_bytes: int = 0) -> PoolStats | None:
    """The public `PoolStats` of `snap` (None when every expert is resident); `slot_bytes`: the slot arrays' size."""
    pst, rs, fs = snap.pool, snap.reads, snap.forward
    if pst is None:
        return None
    assert rs is not None
    ps = snap.predictor
    counters = pst.layers
    hits, misses = pst.hits, pst.misses
    layers = tuple(LayerPoolStats(layer=t.layer, capacity=t.capacity, occupancy=t.occupancy,
                                  hits=counters[t.layer].hits, misses=counters[t.layer].misses,
                                  evictions=counters[t.layer].evictions,
                                  prefetch_recall=counters[t.layer].predicted_used / counters[t.layer].used
                                  if snap.predicting and counters[t.layer].used else 0.0)
                   for t in snap.tables)
    return PoolStats(hits=hits, misses=misses, misses_by_cause=dict(pst.causes),
                     hit_rate=hits / (hits + misses) if hits + misses else 0.0, reads=rs.reads,
                     bytes_read=rs.bytes_read, merged_reads=rs.merged, peak_reads_in_flight=rs.peak_in_flight,
                     device_s=rs.device_s, stall_s=fs.stall_s, steps=fs.steps, layer_steps=fs.layer_steps,
                     split_layer_steps=fs.split_layer_steps, early_grants=fs.early_grants, slot_bytes=slot_bytes,
                     layers=layers, pinned=sum(t.pinned for t in snap.tables), side_hits=pst.side_hits,
                     prefetch_hits=pst.prefetch_hits, victim_hits=pst.victim_hits,
                     prefetch_issued=pst.prefetches_issued, prefetch_done=pst.prefetches_done,
                     prefetch_used=pst.prefetches_used, prefetch_expired=pst.prefetches_expired,
                     useful_prefetch_ratio=pst.prefetches_used / pst.prefetches_issued
                     if pst.prefetches_issued else 0.0,
                     prefetch_recall=pst.recall, wasted_bytes=pst.wasted_bytes,
                     hints=ps.hints if ps is not None else 0,
                     hints_dropped_full=ps.hints_dropped_full if ps is not None else 0,
                     hints_dropped_budget=pst.hints_dropped_budget, candidates_dropped=fs.candidates_dropped,
                     stall_s_by_layer=dict(fs.stall_by_layer),
                     union_prof=tuple(UnionProf(tokens=n, layer=ly, layer_steps=c, mean_union=s / c, max_union=mx)
                                      for (n, ly), (c, s, mx) in sorted(fs.union_sizes.items())))


def engine_stats(totals: EngineStats, snap: PipelineStatistics, *, slot_bytes: int = 0) -> EngineStats:
    """`totals` with the pool's figures of `snap` (unchanged when every expert is resident)."""
    pool = pool_stats(snap, slot_bytes=slot_bytes)
    if pool is None:
        return totals
    return msgspec.structs.replace(totals, expert_bytes_read=pool.bytes_read,
                                   expert_misses_by_cause=dict(pool.misses_by_cause), pool=pool)


__all__ = ["ForwardStatistics", "LayerTable", "PipelineStatistics", "PredictorStatistics", "ReadStatistics",
           "engine_stats", "pool_stats"]
