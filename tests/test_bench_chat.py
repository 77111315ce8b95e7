"""Smoke run of tools/bench_chat.py at small sizes: it runs and prints its JSON line with the issue's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_chat.py"


@pytest.mark.slow
def test_bench_chat_smoke() -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--head", "128", "--tail", "8", "--rounds", "1", "--chunk", "16",
                           "--quality-prompts", "2", "--quality-tokens", "8"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("ttft_ratio", "kv_bytes_ratio", "token_agreement", "logits_cosine", "mlx_lm_4_4"):
        assert key in out, key
    assert out["tokens_equal"] and out["prefix_hits"] == 1 and out["ttft_ratio"] > 1
    assert out["kv_bytes_ratio"] == 4.0 and out["kv_bytes_arithmetic_ok"]
    assert 0 <= out["token_agreement"] <= 1 and out["logits_cosine"] > 0.9
