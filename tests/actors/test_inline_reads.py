"""The miss path's turns taken where their messages are made (qnpipe.actors.read_scheduler.ReadsInline,
qnpipe.actors.pool.PoolInline) log what the actors' channels would.

A real `qnpipe generate --trace` on a streamed tiny model whose pool is too small for a step's experts, both
ways: the read scheduler's turn taken in the pool's (its reads put on the device at once) and the pool's turn
over a finished batch taken in the read scheduler's task, or every message by channel
(`qnpipe.actors.pipeline._inline_reads = False`). Greedy, no autopin, no early grants (their records follow
the reads' timing). The logs hold the same record kinds in the same numbers, the same grants and the same reads
(layer, expert, slot); each way really was taken.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qnpipe import trace
from qnpipe.actors import pipeline
from qnpipe.actors.pool import PoolInline
from qnpipe.actors.read_scheduler import ReadsInline
from qnpipe.cli import main
from qnpipe.messages import Acquire, Granted, ReadDone, Release
from qnpipe.trace.format import ReadStarted

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("inline-reads-model")
    hf = make_tiny(root / "hf", layout="hf", seed=4, config_overrides=SHAPE)
    convert(hf, root / "q")
    return root / "q"


def _run(model: Path, path: Path, inline: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int, int]:
    """The run's records and the turns taken inline: the read scheduler's, the pool's."""
    taken = {"reads": 0, "pool": 0}
    reads_take, pool_take = ReadsInline.take, PoolInline.take

    def reads(self: ReadsInline, msgs: Any) -> bool:
        ok = reads_take(self, msgs)
        taken["reads"] += ok
        return ok

    async def pool(self: PoolInline, done: Any) -> bool:
        ok = await pool_take(self, done)
        taken["pool"] += ok
        return ok

    with monkeypatch.context() as m:
        m.setattr(pipeline, "_inline_reads", inline)
        m.setattr(ReadsInline, "take", reads)
        m.setattr(PoolInline, "take", pool)
        assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "8", "--json", "--temperature", "0",
                     "--set", "pool.expert_slots=4", "--set", "pool.autopin=false",
                     "--set", "forward.early_grants=false", "--trace", str(path)]) == 0
    _, records = trace.read(path)
    return records, taken["reads"], taken["pool"]


def _content(records: list[Any]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in records:
        if isinstance(r, Granted):
            out[("granted", r.step, r.layer, r.part, r.experts, r.slots, r.hits, r.misses)] += 1
        elif isinstance(r, Acquire | Release):
            out[(type(r).__name__, r.step, r.layer, r.part)] += 1
        elif isinstance(r, ReadStarted | ReadDone):
            out[(type(r).__name__, r.layer, r.expert, r.slot)] += 1
    return out


def test_the_miss_path_inline_logs_the_same_records_as_the_channels(streamed: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inline, reads, pools = _run(streamed, tmp_path / "inline.qtrace", True, monkeypatch)
    channel, no_reads, no_pools = _run(streamed, tmp_path / "channel.qtrace", False, monkeypatch)
    assert reads > 0 and pools > 0 and no_reads == no_pools == 0  # each way really was taken
    assert Counter(type(r).__name__ for r in inline) == Counter(type(r).__name__ for r in channel)
    content = _content(channel)
    assert any(k[0] == "ReadDone" for k in content) and _content(inline) == content
    # every read logged as started, then done
    for records in (inline, channel):
        times: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}
        for r in records:
            if isinstance(r, ReadStarted | ReadDone):
                times.setdefault((r.layer, r.expert, r.slot), ([], []))[isinstance(r, ReadDone)].append(r.t)
        for starts, dones in times.values():  # the same slot may be read again later
            assert len(starts) == len(dones)
            assert all(a <= b for a, b in zip(sorted(starts), sorted(dones), strict=True))
