"""Pure, synchronous decision logic of the pipeline: slot tables, eviction, the read queue, the pool.

`slot_table` (one layer's slots) and `eviction` (whom to evict; `eviction_hand`, `_arc`,
`_s3fifo` hold libCacheSim's policies, `_plugin` loads plug-ins, `_protocol` is their interface) under `pool` (every layer's
grants, reads and counters), `read_queue` (the order reads go to the device), `predict`
(which experts to prefetch), `parts` (a step split into parts), `heat` (autopin's counts and
plan). Nothing here imports trio, MLX, qnpipe.io or qnpipe.actors (tests/test_imports.py), so
every decision can be driven and checked directly, without a clock or a device; the actors
are the thin trio shells that drive them.
"""

from __future__ import annotations

from qnpipe.policy.eviction import FIFO, LFU, LRFU, LRU, Eviction, make_eviction
from qnpipe.policy.eviction_arc import ARC
from qnpipe.policy.eviction_hand import Clock, Sieve
from qnpipe.policy.eviction_s3fifo import S3FIFO
from qnpipe.policy.heat import Heat, autopin_plan, pin_budget
from qnpipe.policy.parts import plan_parts
from qnpipe.policy.pool import Grant, HintFate, LayerCounters, MissKind, PoolPolicy, PrefetchBudgets
from qnpipe.policy.predict import hint_top, predict_targets, rank
from qnpipe.policy.read_queue import Job, ReadClass, ReadQueue
from qnpipe.policy.slot_table import AcquirePlan, Load, LoadCause, MissCause, SlotState, SlotTable

__all__ = [
    "ARC", "FIFO", "LFU", "LRFU", "LRU", "S3FIFO", "AcquirePlan", "Clock", "Sieve", "Eviction", "Grant", "Heat", "HintFate", "Job", "LayerCounters",
    "Load", "LoadCause", "MissCause", "MissKind", "PoolPolicy", "PrefetchBudgets", "ReadClass", "ReadQueue", "SlotState",
    "SlotTable", "autopin_plan", "hint_top", "make_eviction", "pin_budget", "plan_parts", "predict_targets", "rank",
]
