"""Smoke run of tools/bench_family.py on a 2-layer Qwen3-Next: the four engines make the same tokens and it
prints its JSON line of tok/s and generic-vs-native ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_family.py"


@pytest.mark.slow
def test_bench_family_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--shape", "smoke", "--work", str(tmp_path), "--rounds", "1",
                           "--tokens", "4", "--workers", "4"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("tok_s_native_streamed", "tok_s_generic_streamed", "tok_s_native_resident", "tok_s_generic_resident"):
        assert out[key] > 0, key
    assert out["generic_vs_native_streamed"] > 0 and out["generic_vs_native_resident"] > 0
