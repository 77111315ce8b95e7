"""Actors, policy and replay read time only through trio's clock, so replay on MockClock stays exact."""

from __future__ import annotations

import re
from pathlib import Path

import qnpipe

ROOT = Path(qnpipe.__file__).parent
CLOCKED = [*(ROOT / "actors").glob("*.py"), *(ROOT / "policy").glob("*.py"), ROOT / "replay" / "runner.py",
           ROOT / "replay" / "actor_driver.py", ROOT / "io" / "simssd.py", ROOT / "live" / "decoding.py"]
WALL = re.compile(r"\btime\.(time|perf_counter|monotonic|process_time)\(|\bdatetime\.now\(")


def wall_clock_reads(paths: list[Path]) -> list[str]:
    return [f"{p.name}:{i}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if WALL.search(line.split("#")[0])]


def test_no_wall_clock_reads_where_time_must_be_trio_time() -> None:
    assert all(p.is_file() for p in CLOCKED)
    assert wall_clock_reads(CLOCKED) == []


def test_the_check_catches_a_wall_clock_read(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("import time\nt0 = time.perf_counter()  # a lap\n# time.time() in a comment is fine\n")
    assert wall_clock_reads([bad]) == ["probe.py:2"]
