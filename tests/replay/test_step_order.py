"""replay.step_order: a step's experts at a layer are served in ascending id (the default, as the live forward
serves them) or, with `router`, in the order the router names them. With router order the pool's LRU equals
libCacheSim's LRU fed the router's order with each step's hits first, on a real Mixtral trace (docs/pool.md,
"Step order"); with id order it need not.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.policy.parts import plan_parts_flat
from qnpipe.replay import load_log, replay
from qnpipe.replay.settings import setting_value
from qnpipe.trace.importers import import_log

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
lcs: Any = importlib.import_module("libcachesim")  # through importlib: pyright runs without it


def _lru_libcachesim(slots: int, requests: Sequence[int]) -> int:
    cache = lcs.LRU(slots)
    hits = 0
    for i, e in enumerate(requests):
        req = lcs.Request()
        req.obj_id, req.obj_size, req.clock_time = e, 1, i
        hits += bool(cache.get(req))
    return hits


def _hits_first(slots: int, steps: Sequence[Sequence[int]]) -> list[int]:
    """The steps' requests one after another, each step's LRU-resident experts first, each group in step order."""
    resident: dict[int, None] = {}
    out: list[int] = []
    for experts in steps:
        order = [e for e in experts if e in resident] + [e for e in experts if e not in resident]
        for e in order:
            resident.pop(e, None)
            resident[e] = None
            if len(resident) > slots:
                del resident[next(iter(resident))]
        out += order
    return out


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("order") / "humaneval.qtrace"
    import_log("mixtral-jsonl", DATA / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl.gz", out,
               max_steps=120)
    return out


def test_router_order_lru_is_libcachesim_fed_the_routers_order_hits_first(mixtral: Path) -> None:
    log = load_log(mixtral)
    k = log.shape.top_k
    differs = 0
    for slots in (2, 5):
        cfg = config.load(None, env={}, overrides={"pool.expert_slots": slots, "pool.evict_policy": "lru"})
        by_router = replay(mixtral, cfg, record_nbytes=1 << 20, step_order="router")
        by_id = replay(mixtral, cfg, record_nbytes=1 << 20)
        assert by_router.step_order == "router" and "experts in router order" in _memory(by_router)
        for x, y in zip(by_router.layers, by_id.layers, strict=True):
            parts = [list(ex) for step in log.steps for layer, experts in step if layer == x.layer
                     for _, _, ex in plan_parts_flat(experts, k, slots, router_order=True)]
            assert x.requests == sum(map(len, parts))
            assert x.hits == _lru_libcachesim(slots, _hits_first(slots, parts)), (x.layer, slots)
            differs += x.hits != y.hits
    assert differs > 0  # the order is a choice that shows in the numbers


def _memory(r: Any) -> str:
    from qnpipe.replay import describe

    return describe(r)


def test_step_order_is_a_checked_replay_setting(mixtral: Path) -> None:
    assert setting_value("replay.step_order", " router ") == "router"
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": 4})
    with pytest.raises(ConfigError, match="replay.step_order='sideways'"):
        replay(mixtral, cfg, record_nbytes=1 << 20, step_order="sideways")
    with pytest.raises(ConfigError, match="fast driver"):
        replay(mixtral, cfg, record_nbytes=1 << 20, step_order="router", driver="actors")


def test_router_order_keeps_each_tokens_experts_and_the_parts_split() -> None:
    experts = [5, 1, 1, 7, 3, 5, 0, 2]
    assert plan_parts_flat(experts, 2, 8, router_order=True) == [(0, 4, (5, 1, 7, 3, 0, 2))]
    assert plan_parts_flat(experts, 2, 8) == [(0, 4, (0, 1, 2, 3, 5, 7))]
    split = plan_parts_flat(experts, 2, 3, router_order=True)
    assert [(lo, hi) for lo, hi, _ in split] == [(lo, hi) for lo, hi, _ in plan_parts_flat(experts, 2, 3)]
    assert split == [(0, 2, (5, 1, 7)), (2, 3, (3, 5)), (3, 4, (0, 2))]
