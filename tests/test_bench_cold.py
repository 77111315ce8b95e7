"""tools/bench_cold.py runs and prints its keys (its figures are this machine's: not asserted)."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from tests.tool_module import load_tool


def _tool() -> ModuleType:
    return load_tool("bench_cold.py")


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
