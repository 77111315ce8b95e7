"""Plug-in eviction policies: `pool.evict_policy = "package.module:Class"` (qnpipe/policy/eviction_plugin.py).

The example of docs/pool.md (tests/policy/evict_plugin_example.py, LRU-2) is loaded through the
config string and replayed; the doc shows that file verbatim. A class that is missing, not a
class, short of a method or of an argument, or that cannot be built is a ConfigError naming the
setting's value.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from evict_plugin_example import LRU2
from hypothesis import given
from hypothesis import strategies as st
from top1_logs import write_top1_log

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.policy.eviction import Eviction, make_eviction
from qnpipe.policy.slot_table import SlotTable
from qnpipe.replay import replay
from tests.profiles import examples

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "pool.md"
SPEC = "evict_plugin_example:LRU2"


def table_hits(policy: Eviction, slots: int, requests: list[int]) -> int:
    t = SlotTable(0, slots, policy)
    hits = 0
    for e in requests:
        plan = t.acquire([e])
        hits += len(plan.hits)
        for ld in plan.loads:
            t.loaded(ld.expert, ld.slot)
        t.release([e])
    return hits


def test_the_doc_shows_the_tested_example() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert (HERE / "evict_plugin_example.py").read_text() in blocks


# fewer: each example loads a plug-in and replays
@examples(30)
@given(slots=st.integers(1, 8), requests=st.lists(st.integers(0, 11), min_size=1, max_size=200))
def test_a_plugin_replays_through_the_config_string(slots: int, requests: list[int],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    log = tmp_path_factory.mktemp("plugin") / "top1.qtrace"
    write_top1_log(log, requests, 12)
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": slots, "pool.evict_policy": SPEC})
    assert cfg.pool.evict_policy == SPEC
    r = replay(log, cfg, record_nbytes=1 << 20)
    assert r.layers[0].hits == table_hits(LRU2(slots), slots, requests)


def test_the_plugin_is_what_runs() -> None:
    """LRU-2 keeps an expert used twice over newer ones used once; LRU does not."""
    requests = [0, 0, 1, 2, 0]  # 2 slots: 2 evicts 1 under LRU-2 (0 was used twice), 0 under LRU
    assert table_hits(make_eviction(SPEC, 2), 2, requests) == 2
    assert table_hits(make_eviction("lru", 2), 2, requests) == 1


@pytest.mark.parametrize(("spec", "fragments"), [
    ("no_such_module_xyz:Policy", ["cannot import module 'no_such_module_xyz'", "ModuleNotFoundError"]),
    ("evict_plugin_example:Missing", ["has no 'Missing'"]),
    ("evict_plugin_broken:NOT_A_CLASS", ["'NOT_A_CLASS' is a int, not a class"]),
    ("evict_plugin_broken:NoPick", ["does not satisfy the Eviction protocol", "no method pick"]),
    ("evict_plugin_broken:OldPick", ["OldPick.pick", "does not take the protocol's 4 arguments"]),
    ("evict_plugin_broken:NoCapacity", ["NoCapacity(capacity=3) failed", "TypeError"]),
    ("lru", ["a built-in policy, not a plug-in"]),
])
def test_a_bad_plugin_is_an_error_naming_the_value(spec: str, fragments: list[str]) -> None:
    from qnpipe.policy.eviction_plugin import make_plugin

    with pytest.raises(ConfigError) as info:
        make_plugin(spec, 3)
    msg = str(info.value)
    assert f"pool.evict_policy={spec!r}" in msg
    for fragment in fragments:
        assert fragment in msg


def test_a_bad_plugin_fails_the_replay_before_it_runs(tmp_path: Path) -> None:
    log = tmp_path / "top1.qtrace"
    write_top1_log(log, [0, 1, 2], 4)
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": 2, "pool.evict_policy": "evict_plugin_broken:NoPick"})
    with pytest.raises(ConfigError, match="evict_plugin_broken:NoPick.*no method pick"):
        replay(log, cfg, record_nbytes=1 << 20)
