"""Autopin's pure parts: heat counting, the pin budget and plan, the pinned preload, the heat file.

The SIGKILL test saves in a loop in a subprocess and kills it at random moments: the file
is always one complete save, old or new.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe.config import EvictPolicy
from qnpipe.errors import CapacityError
from qnpipe.io.heat_file import HeatFileWarning, encode_heat, load_heat, save_heat
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.heat import Heat, autopin_plan, pin_budget
from qnpipe.policy.pool import AcquireResult, PoolPolicy, ReadResult
from qnpipe.policy.slot_table import FREE, LoadCause, SlotState

MID = "a" * 64


def _policy(caps: dict[int, int], heat: Heat | None = None) -> PoolPolicy:
    return PoolPolicy.build(caps, {layer: make_eviction(EvictPolicy.LFU, cap) for layer, cap in caps.items()},
                            {layer: 10 for layer in caps}, heat=heat)


def test_heat_counts_each_expert_once_per_layer_step() -> None:
    h = Heat()
    h.count(1, 0, [3, 4])
    h.count(1, 0, [4, 5])  # second part of the same layer-step: 4 is not counted again
    h.count(1, 2, [3])
    h.count(2, 0, [3])
    assert h.counts == {0: {3: 2, 4: 1, 5: 1}, 2: {3: 1}}
    assert h.hottest(0, 2) == [3, 4]  # ties to the lower id
    assert h.hottest(0, 10) == [3, 4, 5] and h.hottest(7, 3) == [] and h.hottest(0, 0) == []


def test_policy_counts_heat_at_acquire_and_a_deferred_acquire_once() -> None:
    pol = _policy({0: 2}, Heat())
    assert pol.heat is not None
    loads = pol.acquire((1, 0, 0), [1, 2], 0.0).loads
    pol.release((1, 0, 0))  # cancelled: reads of 1 and 2 still in flight
    assert pol.acquire((2, 0, 0), [3], 0.0) == AcquireResult()  # deferred: the slots are still loading
    pol.read_done(0, loads[0].expert, loads[0].slot)  # takes the deferred acquire up again
    assert pol.heat.counts == {0: {1: 1, 2: 1, 3: 1}}
    pol.forward_done()
    assert pol.heat.forwards == 1


@given(cap=st.integers(1, 64), k=st.integers(1, 8), frac=st.floats(0.0, 1.0))
def test_pin_budget_is_floor_of_frac_and_leaves_top_k(cap: int, k: int, frac: float) -> None:
    n = pin_budget(cap, k, frac)
    assert 0 <= n <= int(frac * cap)
    assert n == 0 or cap - n >= k
    if cap - int(frac * cap) >= k:
        assert n == int(frac * cap)


def test_autopin_plan_takes_the_hottest_within_the_budget() -> None:
    h = Heat({0: {1: 5, 2: 9, 3: 1, 4: 0}, 1: {7: 2}, 2: {1: 3}})
    # layer 0: floor(0.5 * 8) = 4, but only 3 experts have heat; layer 1: floor(0.5 * 3) = 1, 3 - 1 >= 2;
    # layer 2: capacity == top-k, nothing pinned.
    assert autopin_plan(h, {0: 8, 1: 3, 2: 2}, 2, 0.5) == {0: [2, 1, 3], 1: [7]}
    assert autopin_plan(h, {0: 8}, 2, 0.25) == {0: [2, 1]}
    assert autopin_plan(h, {0: 8}, 2, 0.0) == {}


def test_preload_pins_experts_in_the_pool_and_names_their_reads() -> None:
    pol = _policy({0: 4, 1: 3})
    loads = pol.preload(0, [5, 9])
    t = pol.tables[0]
    assert [(ld.expert, ld.slot, ld.evicted, ld.cause) for ld in loads] == [
        (5, 0, FREE, LoadCause.COLD), (9, 1, FREE, LoadCause.COLD)]
    assert t.pinned == {5, 9} and t.occupancy == 2 and not t.held
    assert pol.counters[0].cold == 2 and pol.counters[0].misses == 0 and pol.counters[0].hits == 0
    for ld in loads:
        assert pol.read_done(0, ld.expert, ld.slot) == ReadResult()
    assert t.state[0] is SlotState.READY and t.state[1] is SlotState.READY and SlotState.LOADING not in t.state
    # Steps now hit the pinned experts, and never evict them.
    for step, e in enumerate(range(10, 20), start=1):
        for ld in pol.acquire((step, 0, 0), [e, 9], 0.0).loads:
            pol.read_done(0, ld.expert, ld.slot)
        pol.release((step, 0, 0))
        assert {5, 9} <= set(t.slot_of) and t.occupancy <= 4
    assert pol.counters[0].hits == 10 and pol.counters[0].evictions > 0
    # A step needing more than capacity minus pins fails before it changes anything.
    with pytest.raises(CapacityError):
        pol.acquire((99, 0, 0), [30, 31, 32], 0.0)
    with pytest.raises(CapacityError):
        pol.preload(1, [1, 2, 3, 4])


def test_heat_file_round_trip(tmp_path: Path) -> None:
    counts = {0: {3: 7, 1: 2}, 12: {0: 1}}
    p = tmp_path / "pool_usage.json"
    save_heat(p, MID, counts)
    assert load_heat(p, MID) == counts
    assert list(tmp_path.iterdir()) == [p]  # no temporary file left behind
    save_heat(p, MID, {})
    assert load_heat(p, MID) == {}
    assert load_heat(tmp_path / "missing.json", MID) == {}  # first run: silent zero start


@pytest.mark.parametrize(("data", "reason"), [
    (b"{not json", "not a heat file"),
    (b"", "not a heat file"),
    (b'{"format": "qnpipe-heat", "version": 2, "model_id": "' + MID.encode() + b'", "layers": {}}', "version 2"),
    (b'{"format": "other", "version": 1, "model_id": "' + MID.encode() + b'", "layers": {}}', "format 'other'"),
    (b'{"format": "qnpipe-heat", "version": 1, "model_id": "' + MID.encode() + b'", "layers": {"x": {}}}',
     "not a heat file"),
    (encode_heat("b" * 64, {0: {1: 1}}), "another model"),
])
def test_an_unusable_heat_file_warns_once_and_starts_from_zero(tmp_path: Path, data: bytes, reason: str) -> None:
    p = tmp_path / "pool_usage.json"
    p.write_bytes(data)
    with pytest.warns(HeatFileWarning) as rec:
        assert load_heat(p, MID) == {}
    assert len(rec) == 1
    assert str(p) in str(rec[0].message) and reason in str(rec[0].message)


@pytest.mark.parametrize(("counts", "reason"), [
    ({0: {64: 3}}, "layer 0: expert 64 out of range (the model has 64 experts)"),
    ({0: {1: 3}, 2: {-1: 1}}, "layer 2: expert -1 out of range"),
    ({0: {1: 3}, 99: {1: 1}}, "layer 99 is not a MoE layer of this model"),
    ({5: {1: 1}}, "layer 5 is not a MoE layer"),
])
def test_a_heat_file_naming_what_the_model_lacks_warns_and_starts_from_zero(
        tmp_path: Path, counts: dict[int, dict[int, int]], reason: str) -> None:
    """Issue 22 item 9: an out-of-range expert or layer is the file's fault, never the model's."""
    p = tmp_path / "pool_usage.json"
    save_heat(p, MID, counts)
    assert load_heat(p, MID) == counts  # the file itself is well formed
    with pytest.warns(HeatFileWarning) as rec:
        assert load_heat(p, MID, num_experts=64, layers=(0, 1, 2, 8)) == {}
    assert len(rec) == 1 and str(p) in str(rec[0].message) and reason in str(rec[0].message)


@pytest.mark.parametrize("kind", ["fifo", "directory", "too large"])
def test_a_heat_file_that_is_not_a_small_regular_file_warns_without_blocking(tmp_path: Path, kind: str) -> None:
    from qnpipe.io.heat_file import HEAT_CAP

    p = tmp_path / "pool_usage.json"
    if kind == "fifo":
        os.mkfifo(p)  # no writer: a plain read would block for good
    elif kind == "directory":
        p.mkdir()
    else:
        with open(p, "wb") as f:
            f.truncate(HEAT_CAP + 1)
    with pytest.warns(HeatFileWarning) as rec:
        assert load_heat(p, MID) == {}
    assert len(rec) == 1 and str(p) in str(rec[0].message) and "unreadable" in str(rec[0].message)


_SAVER = """
import sys
from qnpipe.io.heat_file import save_heat
path, mid = sys.argv[1], sys.argv[2]
print("ready", flush=True)
i = 0
while True:
    i += 1
    save_heat(path, mid, {layer: {e: i for e in range(64)} for layer in range(48)})
"""


def test_sigkill_during_saves_never_leaves_a_torn_file(tmp_path: Path) -> None:
    p = tmp_path / "pool_usage.json"
    save_heat(p, MID, {0: {0: 0}})
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    seen = set()
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(p), MID], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        counts = load_heat(p, MID)  # would warn (an error here) if torn
        assert counts
        values = {c for row in counts.values() for c in row.values()}
        assert len(values) == 1  # one complete save: every count from the same iteration
        seen |= values
    assert len(seen) > 1  # the kills did land between different saves
