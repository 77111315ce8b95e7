"""tools/bench_cold.py runs and prints its keys (its figures are this machine's: not asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_cold.py"


def _tool():  # noqa: ANN202 - a module loaded from its path
    spec = importlib.util.spec_from_file_location("bench_cold", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_cold"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bench_cold_prints_its_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert _tool().main(["--rounds", "1", "--calls", "3", "--waits-ms", "1", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("us_back_to_back", "us_after_block_1", "us_after_spin_1", "us_after_block_4", "us_after_spin_4",
                "ratio_after_block_4ms", "ratio_after_block_1ms", "loadavg_start_end"):
        assert key in out, key
    assert all(out[k] > 0 for k in out if k.startswith("us_"))


def test_bench_cold_refuses_a_wait_of_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _tool().main(["--waits-ms", "0"])
    assert "--waits-ms" in capsys.readouterr().err
