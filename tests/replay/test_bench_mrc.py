"""Smoke run of tools/bench_mrc.py on a small synthetic log: it runs and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_mrc.py"


@pytest.mark.slow
def test_bench_mrc_prints_its_keys() -> None:
    args = [sys.executable, str(TOOL), "--layers", "3", "--experts", "16", "--top-k", "2", "--tokens", "50"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("mrc_s", "mrc_cpu_s", "load_s", "lru_s", "belady_s", "digest"):
        assert key in out, key
    assert out["layer_steps"] == 3 * 50 and out["requests"] == 3 * 50 * 2 and out["capacities"] == 15
    lru, opt = out["hit_rate_lru"], out["hit_rate_belady"]
    assert lru["16"] == opt["16"] and all(lru[c] <= opt[c] for c in lru)  # all fit at 16; Belady is the bound
