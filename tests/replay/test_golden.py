"""Golden replays: committed logs with their expected reports, regenerated only by tools/regen_golden.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "regen_golden.py"
_spec = importlib.util.spec_from_file_location("regen_golden", TOOL)
assert _spec is not None and _spec.loader is not None
regen = importlib.util.module_from_spec(_spec)
sys.modules["regen_golden"] = regen
_spec.loader.exec_module(regen)


@pytest.mark.parametrize("driver", ["fast", "actors"])
@pytest.mark.parametrize("case", sorted(regen.CASES))
def test_replay_report_matches_its_golden_file(case: str, driver: str) -> None:
    expected = regen.GOLDEN / f"{case}.json"
    assert expected.is_file(), f"{expected} is missing: run python tools/regen_golden.py"
    got = regen.golden_report(case, driver=driver)
    assert got == expected.read_bytes(), (
        f"the replay report of golden case {case!r} differs from {expected}. If the change is meant to change "
        f"replay results, run `python tools/regen_golden.py` and commit the new files (review their diff)")


def test_golden_logs_are_what_their_seeds_generate(tmp_path: Path) -> None:
    for name in regen.LOGS:
        regen.write_log(name, tmp_path / f"{name}.qtrace")
        assert (tmp_path / f"{name}.qtrace").read_bytes() == (regen.GOLDEN / f"{name}.qtrace").read_bytes(), (
            f"{name}.qtrace differs from its seed's log: run `python tools/regen_golden.py --logs`")
