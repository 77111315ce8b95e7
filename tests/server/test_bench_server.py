"""Smoke run of tools/bench_server.py: it runs, both paths make the same text, and it prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_server.py"


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "client"), [([], "process"), (["--client-in-process"], "thread")])
def test_bench_server_smoke(flags: list[str], client: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--tokens", "8", "--rounds", "2", *flags],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ratio_http_to_direct"] > 0 and out["tok_s_direct"] > 0 and out["tok_s_http"] > 0
    assert out["same_text"] is True
    assert out["client"] == client and out["client_cpu_ms_per_token"] > 0
