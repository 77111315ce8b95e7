"""docs/replay.md's "From Python / a notebook" section: its python blocks run, in order, as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "replay.md"
SECTION = "## From Python / a notebook"


def blocks() -> list[str]:
    """The section's ```python blocks, in order."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC}: no section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    body = re.split(r"^## ", body, maxsplit=1, flags=re.M)[0]
    return re.findall(r"^```python\n(.*?)^```$", body, flags=re.M | re.S)


def test_the_notebook_section_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = blocks()
    assert len(code) >= 4  # replay, sweep, table, miss-ratio curves
    monkeypatch.chdir(tmp_path)  # the section runs in an empty directory
    ns: dict[str, object] = {"__name__": "notebook"}
    for i, block in enumerate(code):
        exec(compile(block, f"{DOC.name} python block {i + 1}", "exec"), ns)  # noqa: S102
    out = capsys.readouterr().out
    assert out.startswith("replay of synth.qtrace: 200 steps")
    report, result, rows, mrc = ns["report"], ns["result"], ns["rows"], ns["mrc"]
    assert 0 < report.hit_rate <= 1 and report.warnings == []  # type: ignore[attr-defined]
    assert len(result.points) == 9 and not result.failed  # type: ignore[attr-defined]
    assert rows == result.rows()  # type: ignore[attr-defined]
    # the curve at 8 slots is the LRU replay's at 8 slots, as the sweep measured it
    at8 = next(p for p in result.points if p.values == {"pool.expert_slots": 8, "pool.evict_policy": "lru"})  # type: ignore[attr-defined]
    lru = mrc.curve("lru", "all")  # type: ignore[attr-defined]
    assert lru.hit_rate()[list(lru.capacities).index(8)] == pytest.approx(at8.metrics["hit_rate"])
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hit_rate-vs-pool.evict_policy.svg", "hit_rate-vs-pool.expert_slots.svg"]
    assert (tmp_path / "sweep.csv").read_text().splitlines()[0].startswith("point,pool.expert_slots,")
