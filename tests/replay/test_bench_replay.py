"""Smoke run of tools/bench_replay.py on a small synthetic log: it runs and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_replay.py"


@pytest.mark.slow
def test_bench_replay_prints_its_keys_and_a_stable_digest() -> None:
    args = [sys.executable, str(TOOL), "--layers", "4", "--experts", "32", "--top-k", "2", "--tokens", "30",
            "--slots", "8", "--side", "2", "--repeat", "2"]
    outs = []
    for extra in ([], ["--predict", "transition", "--train-frac", "0.2"]):
        proc = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    a, b = outs
    for key in ("layer_steps_per_s", "layer_steps_per_cpu_s", "layer_steps", "replay_s", "digest"):
        assert key in a, key
    assert a["layer_steps"] == 30 * 4 and a["layer_steps_per_s"] > 0 and a["predictor"] == "previous"
    assert b["layer_steps"] == 24 * 4 and b["predictor"] == "transition"  # the first 20% train
    assert a["digest"] != b["digest"]  # (the tool exits 1 when its repeated replays differ)
