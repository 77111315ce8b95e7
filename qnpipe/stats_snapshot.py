"""The pipeline's figures as one frozen snapshot (`Pipeline.statistics()`, qnpipe.actors.pipeline).

Each figure is copied from the one actor that counts it: hits, misses and prefetches from the
pool policy, reads and bytes from the read scheduler (the records the device gave back),
stalls and steps from the forward, hints from the predictor. The public `PoolStats` is made
of it by one pure function (qnpipe.stats.pool_stats), so the engine's stats, the server's
metrics and `--stats` read the same figures. No trio, no MLX, nothing above the actors: the
actors import it.
"""

from __future__ import annotations

import attrs

from qnpipe.io.reader import ReaderStats
from qnpipe.io.sim_model import SimStatistics
from qnpipe.policy.pool import PoolStatistics


@attrs.frozen(kw_only=True)
class LayerTable:
    """One MoE layer's resident slot table now."""

    layer: int
    capacity: int
    occupancy: int
    pinned: int


@attrs.frozen(kw_only=True)
class ReadStatistics:
    """The read scheduler's counters (device time sums batch wall times, which may overlap).

    `merged` and `peak_in_flight` are its queue's (qnpipe.policy.read_queue): the queue merges and starts reads.
    """

    requests: int
    merged: int
    batches: int
    reads: int
    bytes_read: int
    device_s: float
    peak_in_flight: int
    promoted: int
    expired: int


@attrs.frozen(kw_only=True)
class ForwardStatistics:
    """The forward's counters; `union_sizes`: (tokens, layer) -> (layer-steps, sum, max) of distinct experts."""

    steps: int
    layer_steps: int
    split_layer_steps: int
    early_grants: int
    stall_s: float
    stall_by_layer: dict[int, float]
    candidates_dropped: int
    union_sizes: dict[tuple[int, int], tuple[int, int, int]]


@attrs.frozen(kw_only=True)
class PredictorStatistics:
    """The predictor's counters (zero when prediction is off)."""

    candidates: int
    hints: int
    hints_dropped_full: int  # the pool's inbox was full
    experts_hinted: int


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


__all__ = ["ForwardStatistics", "LayerTable", "PipelineStatistics", "PredictorStatistics", "ReadStatistics"]
