"""`qnpipe replay LOG` replays at the slots the log was recorded with (its header's capacities) unless the slots are
given, and says so; the report's text gives misses by cause in words and says when prefetch was off."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from route_logs import NBYTES, SHAPE

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.replay import describe, replay


def _log(path: Path, capacities: dict[int, int], policy: str | None = None) -> Path:
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=SHAPE,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes",
                                             capacities=capacities,
                                             evict_policy=policy if policy is not None else msgspec.UNSET))
    rng = random.Random(5)
    seq = 0
    for step in range(1, 30):
        for layer in SHAPE.moe_layers:
            w.write(trace.Route(t=0.0, seq=seq, step=step, layer=layer, top_k=2, experts=tuple(rng.sample(range(9), 2))))
            seq += 1
    w.close(0, 0.0)
    return path


def test_the_logs_recorded_slots_are_used_unless_given_and_the_report_says_so(tmp_path: Path) -> None:
    log = _log(tmp_path / "r.qtrace", {0: 3, 1: 3, 2: 5, 3: 3})
    r = replay(log, config.load(None, env={}), record_nbytes=NBYTES)
    assert r.capacities == {0: 3, 1: 3, 2: 5, 3: 3} and r.settings_from_log == ["pool.expert_slots"]
    assert "as the log was recorded: slots 3-5 per layer (pool.expert_slots) (not given" in describe(r)
    assert "(lfu eviction, prefetch off)" in describe(r)
    given = replay(log, config.load(None, env={}, overrides={"pool.expert_slots": 4}), record_nbytes=NBYTES)
    assert given.capacities == dict.fromkeys(range(4), 4) and given.settings_from_log == []
    assert "recorded with" not in describe(given)
    # a log without recorded slots: the config's, as before
    bare = replay(_log(tmp_path / "bare.qtrace", {}), config.load(None, env={}), record_nbytes=NBYTES)
    assert bare.settings_from_log == [] and set(bare.capacities.values()) == {16}


def test_the_cli_report_prints_misses_in_words_and_prefetch_off(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(tmp_path / "r.qtrace", {0: 3, 1: 3, 2: 3, 3: 3})
    assert main(["replay", str(log), "--set", f"replay.record_nbytes={NBYTES}"]) == 0
    out = capsys.readouterr().out
    assert "misses capacity " in out and ", cold " in out and "{" not in out
    assert "(lfu eviction, prefetch off)" in out and "prefetch into" not in out
    assert "as the log was recorded: slots 3 per layer (pool.expert_slots)" in out


def test_the_logs_recorded_policy_is_used_unless_given(tmp_path: Path) -> None:
    log = _log(tmp_path / "r.qtrace", {0: 3, 1: 3, 2: 3, 3: 3}, policy="fifo")
    r = replay(log, config.load(None, env={}), record_nbytes=NBYTES)
    assert r.evict_policy == "fifo" and r.settings_from_log == ["pool.expert_slots", "pool.evict_policy"]
    assert "fifo eviction (pool.evict_policy)" in describe(r)
    fifo = replay(log, config.load(None, env={}, overrides={"pool.expert_slots": 3, "pool.evict_policy": "fifo"}),
                  record_nbytes=NBYTES)
    assert (r.hit_rate, r.misses_by_cause) == (fifo.hit_rate, fifo.misses_by_cause)
    lru = replay(log, config.load(None, env={}, overrides={"pool.evict_policy": "lru"}), record_nbytes=NBYTES)
    assert lru.evict_policy == "lru" and lru.settings_from_log == ["pool.expert_slots"]


def test_a_log_a_run_writes_records_its_slots_and_policy_and_replays_as_it(tmp_path: Path) -> None:
    src = _log(tmp_path / "src.qtrace", {})
    events = tmp_path / "events.qtrace"
    cfg = config.load(None, env={}, overrides={"pool.expert_slots": 5, "pool.evict_policy": "clock",
                                               "trace.event_log_path": str(events)})
    first = replay(src, cfg, record_nbytes=NBYTES)
    header, _, _ = trace.read_all(events)
    assert header.evict_policy == "clock" and set(header.capacities.values()) == {5}
    again = replay(events, config.load(None, env={}), record_nbytes=NBYTES)
    assert again.settings_from_log == ["pool.expert_slots", "pool.evict_policy"]
    assert (again.capacities, again.evict_policy, again.hit_rate) == (first.capacities, "clock", first.hit_rate)
