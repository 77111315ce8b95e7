"""The eviction policies against libCacheSim (the `libcachesim` Python package, a test dependency).

Top-1 logs (one expert per step at one layer, so holding a step's experts together changes
nothing): the pool's hit count under LRU, FIFO, CLOCK, ARC, S3-FIFO and SIEVE equals
libCacheSim's exactly, with `cache_size` = the slots and every object of size 1. The logs are
replayed by `qnpipe.replay` (the fast driver: acquire, read, grant, release per step, as the
live pool does), on random request streams and on each real trace of tests/data/traces: one
layer's requests token after token, each token's experts in the order the log lists them,
as a top-1 log ("per-expert sequential"). S3-FIFO is compared from 20 slots up: below,
libCacheSim's S3-FIFO caches nothing with unit-size objects (and aborts below 10), which a
pool cannot do (docs/pool.md).

Top-k logs: the pool looks up all of a step's experts before it places any miss, and holds
them until the step ends, so a miss never evicts an expert of its own step; libCacheSim
serves the same requests one after another. For LRU that is only an order (the least recent
expert is never one the step just touched), so the pool equals libCacheSim fed each step
hits first; FIFO shows the hold itself.
"""

from __future__ import annotations

import importlib
import tarfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from top1_logs import write_top1_log

from qnpipe import config
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.slot_table import SlotTable
from qnpipe.replay import load_log, replay
from qnpipe.trace.importers import import_log
from tests.profiles import examples

lcs: Any = importlib.import_module("libcachesim")  # through importlib: pyright runs without it

CLASSES = {"lru": "LRU", "fifo": "FIFO", "clock": "Clock", "arc": "ARC", "s3fifo": "S3FIFO", "sieve": "Sieve"}
S3FIFO_MIN_SLOTS = 20
DATA = Path(__file__).resolve().parents[1] / "data" / "traces"


def libcachesim_hits(policy: str, slots: int, requests: Sequence[int]) -> int:
    cache = getattr(lcs, CLASSES[policy])(slots)
    hits = 0
    for i, e in enumerate(requests):
        req = lcs.Request()
        req.obj_id, req.obj_size, req.clock_time = e, 1, i
        hits += bool(cache.get(req))
    return hits


def pool_hits(log: Path, policy: str, slots: int) -> int:
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": slots, "pool.evict_policy": policy})
    r = replay(log, cfg, record_nbytes=1 << 20)
    (layer,) = r.layers
    assert layer.requests == len(load_log(log).steps)
    return layer.hits


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(CLASSES))
# fewer: each example runs libCacheSim on a file
@examples(25)
@given(data=st.data())
def test_top1_random_streams_hit_as_in_libcachesim(policy: str, data: st.DataObject, tmp_path_factory:
                                                   pytest.TempPathFactory) -> None:
    low = S3FIFO_MIN_SLOTS if policy == "s3fifo" else 1
    slots = data.draw(st.integers(low, low + 24), label="slots")
    experts = data.draw(st.integers(slots, 3 * slots + 4), label="experts")
    # Skewed streams (a hot few and a long tail) make the policies differ; uniform ones fill the ghosts.
    hot = data.draw(st.integers(1, experts), label="hot")
    ids = st.one_of(st.integers(0, hot - 1), st.integers(0, experts - 1))
    requests = data.draw(st.lists(ids, min_size=50, max_size=500), label="requests")
    log = tmp_path_factory.mktemp("lcs") / "top1.qtrace"
    write_top1_log(log, requests, experts)
    assert pool_hits(log, policy, slots) == libcachesim_hits(policy, slots, requests)


# ------------------------------------------------------------------ real traces


@pytest.fixture(scope="module")
def flame_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flame")
    with tarfile.open(DATA / "Akash-N-Pai__DynaNDE-Simulator" / "Sample_routing_traces.tar.gz") as t:
        t.extractall(root, filter="data")
    return root / "Sample_routing_traces"


# (name, format, source, steps imported, layer, slots): slots up to the experts of the model (8, 60, 64)
REAL = [
    ("mixtral-humaneval", "mixtral-jsonl", DATA / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl.gz",
     200, 5, (2, 4, 6)),
    ("mixtral-raw", "mixtral-jsonl", DATA / "Mario928__speculative-moe" / "routing_raw.jsonl.gz", 30, 17, (3, 5)),
    ("qwen-layer12", "vllm-jsonl", DATA / "weiran0129__vLLM-MoE-Logger" / "moe_layer12.jsonl.gz", 300, 12,
     (8, 20, 32)),
    ("qwen-totani", "vllm-jsonl", DATA / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz", 300,
     None, (12, 24)),
    ("flame-sequences", "flame-pt", Path("Encoder_Batch_0-32"), 100, 4, (10, 20, 40)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fmt", "src", "steps", "layer", "caps"), REAL, ids=[r[0] for r in REAL])
def test_top1_real_traces_hit_as_in_libcachesim(name: str, fmt: str, src: Path, steps: int, layer: int | None,
                                                caps: tuple[int, ...], flame_dir: Path, tmp_path: Path) -> None:
    imported = tmp_path / f"{name}.qtrace"
    import_log(fmt, src if src.is_absolute() else flame_dir / src, imported, max_steps=steps)
    log = load_log(imported)
    if layer is None:  # the layer with the most requests
        per_layer = Counter(ly for step in log.steps for ly, experts in step for _ in experts)
        layer = per_layer.most_common(1)[0][0]
    requests = [e for step in log.steps for ly, experts in step if ly == layer for e in experts]
    assert len(requests) > 300, "too short a stream to tell policies apart"
    top1 = tmp_path / f"{name}-layer{layer}-top1.qtrace"
    write_top1_log(top1, requests, log.shape.num_experts)
    for slots in caps:
        for policy in CLASSES:
            if policy == "s3fifo" and slots < S3FIFO_MIN_SLOTS:
                continue
            assert pool_hits(top1, policy, slots) == libcachesim_hits(policy, slots, requests), (policy, slots)


# ------------------------------------------------------------------ top-k: the documented difference


def table_hits(policy: str, slots: int, steps: Sequence[Sequence[int]]) -> tuple[int, list[list[int]]]:
    """Hits and each step's evicted experts through one SlotTable, a step at a time as the pool serves it."""
    t = SlotTable(0, slots, make_eviction(policy, slots))
    hits, evicted = 0, []
    for experts in steps:
        plan = t.acquire(experts)
        hits += len(plan.hits)
        evicted.append([ld.evicted for ld in plan.loads if ld.evicted >= 0])
        for ld in plan.loads:
            t.loaded(ld.expert, ld.slot)
        t.release(experts)
    return hits, evicted


def hits_first(slots: int, steps: Sequence[Sequence[int]]) -> list[int]:
    """The requests of `steps` one after another, each step's resident experts (under LRU) first."""
    resident: dict[int, None] = {}
    out = []
    for experts in steps:
        order = [e for e in experts if e in resident] + [e for e in experts if e not in resident]
        for e in order:
            resident.pop(e, None)
            resident[e] = None
            if len(resident) > slots:
                del resident[next(iter(resident))]
        out += order
    return out


# fewer: each example runs libCacheSim
@pytest.mark.slow
@examples(60)
@given(data=st.data(), k=st.integers(2, 4))
def test_topk_lru_is_libcachesim_with_each_step_hits_first(data: st.DataObject, k: int) -> None:
    slots = data.draw(st.integers(k, k + 8))
    steps = data.draw(st.lists(st.lists(st.integers(0, 2 * slots + 3), min_size=1, max_size=k, unique=True),
                               min_size=1, max_size=120))
    requests = hits_first(slots, steps)
    assert table_hits("lru", slots, steps)[0] == libcachesim_hits("lru", slots, requests)


def test_topk_fifo_differs_by_the_hold_only() -> None:
    """2 slots, steps [0], [1], [0, 2], [0]. libCacheSim, one request after another (0 1 0 2 0): 0 hits at the
    third request, then 2 evicts the oldest insertion, 0, so the last request misses: 1 hit. The pool holds 0
    for the step that needs it with 2, so 2 evicts 1, and the last step hits: 2 hits."""
    steps = [[0], [1], [0, 2], [0]]
    requests = [e for s in steps for e in s]
    assert libcachesim_hits("fifo", 2, requests) == 1
    hits, evicted = table_hits("fifo", 2, steps)
    assert (hits, evicted) == (2, [[], [], [1], []])
    # The same requests with the step split in two (nothing held across 0 and 2): the pool is libCacheSim again.
    assert table_hits("fifo", 2, [[e] for e in requests]) == (1, [[], [], [], [0], [1]])
