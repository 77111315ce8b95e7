"""tools/prefetch_why.py: the event-log figures behind its explanation, and a smoke run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qnpipe.messages import ForwardDone, Promote, ReadDone, ReadExpert
from qnpipe.policy.read_queue import ReadClass
from qnpipe.trace import Stalled

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("prefetch_why", TOOLS / "prefetch_why.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["prefetch_why"] = mod
    spec.loader.exec_module(mod)
    return mod


prefetch_why = _load()


def _req(t: float, expert: int, cls: ReadClass = ReadClass.DEMAND) -> ReadExpert:
    return ReadExpert(t=t, seq=0, layer=0, expert=expert, slot=expert, cls=cls)


def _done(t: float, expert: int, started: float, nbytes: int = 100) -> ReadDone:
    return ReadDone(t=t, seq=0, layer=0, expert=expert, slot=expert, nbytes=nbytes, issued_t=started, started_t=started)


def test_prefetch_in_flight_counts_the_intervals_holding_each_start() -> None:
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert prefetch_why.prefetch_in_flight(spans, [0.5, 1.5, 2.0, 4.0, 5.0]) == [1, 2, 1, 0, 1]
    assert prefetch_why.prefetch_in_flight([], [1.0]) == [0]


def test_read_figures_splits_the_reads_by_class_and_times_the_demand_ones() -> None:
    records = [
        _req(0.0, 1, ReadClass.PREFETCH), _req(0.0, 2, ReadClass.PREFETCH),
        _req(0.5, 3), _req(0.5, 4),  # one demand batch, started at 1.0 while both prefetches are on the device
        _req(0.6, 2),  # merged into the prefetch in flight: still a prefetch read
        _req(0.7, 5, ReadClass.PREFETCH), Promote(t=0.8, seq=0, layer=0, expert=5),  # a step now waits on it
        _done(2.0, 1, started=0.2, nbytes=300), _done(2.5, 2, started=0.2, nbytes=300),
        _done(3.0, 3, started=1.0), _done(3.4, 4, started=1.0),
        _done(4.0, 5, started=3.5),
        Stalled(t=4.0, seq=0, step=1, layer=0, part=0, misses=2, waited_s=0.25),
        ForwardDone(t=4.1, seq=0, step=1), ForwardDone(t=5.0, seq=0, step=2),
    ]
    f = prefetch_why.read_figures(records)
    assert (f.steps, f.demand_reads, f.prefetch_reads) == (2, 3, 2)
    assert f.demand_bytes_per_step == 150 and f.prefetch_bytes_per_step == 300
    assert f.stall_ms_per_step == pytest.approx(125.0)
    assert f.demand_read_ms == pytest.approx(2000.0)  # median of 2.0, 2.4 and 0.5 s
    assert f.demand_reads_per_batch == pytest.approx(1.5)  # started at 1.0 (two) and 3.5 (one)
    # at 1.0 both prefetches were on the device, at 3.5 none
    assert f.prefetch_in_flight_at_demand == pytest.approx((2 + 2 + 0) / 3)
    assert f.demand_behind_prefetch == pytest.approx(2 / 3)


@pytest.mark.slow
def test_prefetch_why_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "prefetch_why.py"), "--shape", "smoke", "--work", str(tmp_path), "--rounds", "1",
         "--tokens", "4", "--bw-seconds", "0.1", "--workers", "4", "--side", "4", "--width", "6",
         "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reads"]["demand"]["prefetch_reads"] == 0 and out["reads"]["prefetch"]["prefetch_reads"] > 0
    assert out["misses_per_token_prefetch"] < out["misses_per_token_demand"]
    assert set(out["replay"]) == {"this_device", "apple-m5-internal", "apple-m5-internal_no_hop"}
    for row in out["replay"].values():
        assert row["none"]["ratio_to_none"] == 1.0
        assert row["oracle_recall_1"]["misses_per_token"] <= row["none"]["misses_per_token"]
    assert len(out["why"]) == 5
    assert (tmp_path / "logs" / "prefetch.qtrace").exists()
