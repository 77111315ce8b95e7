"""`trace stats`' reuse distance bounds the pool's LRU from above and the text says so, pointing to `--mrc`: on a
real Mixtral trace, at every capacity c the reuses at distance < c are at least the held-step LRU's hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.replay.mrc import miss_ratio_curves
from qnpipe.trace.importers import import_log
from qnpipe.trace.stats import describe, trace_stats

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bound") / "humaneval.qtrace"
    import_log("mixtral-jsonl", DATA / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl.gz", out,
               max_steps=150)
    return out


def test_the_reuse_share_below_c_bounds_the_held_step_lru_hits_at_c(mixtral: Path) -> None:
    stats = trace_stats(mixtral)
    lru = miss_ratio_curves(mixtral, policies=["lru"]).curve("lru")
    counts = stats.total.reuse_counts
    above = 0
    for cap, hits in zip(lru.capacities, lru.hits, strict=True):
        bound = sum(counts[:cap])
        assert hits <= bound, (cap, hits, bound)
        above += hits < bound
    assert above > 0  # a bound, not an equality: the text must not read as one
    text = describe(stats)
    assert "at most this share of reuses hit in an LRU of c slots" in text and "--mrc" in text
