"""Hits answered in the forward's turn (qnpipe.actors.pool.InlinePool) log what the actors' channels would.

A real `qnpipe generate --trace` on a streamed tiny model, once with inline hits and once with
every message by channel (`qnpipe.actors.pipeline._inline_hits = False`), greedy, no autopin
(its heat would carry over) and no early grants (their records follow the reads' timing): the event logs hold
the same record kinds in the same numbers, and the same grants (step, layer, part, experts,
slots, hits, misses); only the times may differ.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qnpipe import trace
from qnpipe.actors import pipeline
from qnpipe.actors.pool import InlinePool
from qnpipe.cli import main
from qnpipe.messages import Acquire, Granted, Release

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("inline-model")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE)
    convert(hf, root / "q")
    return root / "q"


def _run(model: Path, path: Path, slots: int, inline: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int]:
    answered = 0
    real = InlinePool.answer

    def counting(self: InlinePool, msgs: Any) -> Any:
        nonlocal answered
        g = real(self, msgs)
        answered += g is not None
        return g

    with monkeypatch.context() as m:
        m.setattr(pipeline, "_inline_hits", inline)
        m.setattr(InlinePool, "answer", counting)
        assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "6", "--json", "--temperature", "0",
                     "--set", f"pool.expert_slots={slots}", "--set", "pool.autopin=false",
                     # early grants' Present records follow the reads' real timing: not the same twice
                     "--set", "forward.early_grants=false", "--trace", str(path)]) == 0
    _, records = trace.read(path)
    return records, answered


def _grants(records: list[Any]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in records:
        if isinstance(r, Granted):
            out[("granted", r.step, r.layer, r.part, r.experts, r.slots, r.hits, r.misses)] += 1
        elif isinstance(r, Acquire | Release):
            out[(type(r).__name__, r.step, r.layer, r.part)] += 1
    return out


@pytest.mark.parametrize("slots", [16, 6])  # every expert fits (hits after the first reads); hits and misses mixed
def test_inline_hits_log_the_same_records_as_the_channels(streamed: Path, tmp_path: Path, slots: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    inline, n_inline = _run(streamed, tmp_path / "inline.qtrace", slots, True, monkeypatch)
    channel, n_channel = _run(streamed, tmp_path / "channel.qtrace", slots, False, monkeypatch)
    assert n_inline > 0 and n_channel == 0  # the two ways really were taken
    assert Counter(type(r).__name__ for r in inline) == Counter(type(r).__name__ for r in channel)
    assert _grants(inline) == _grants(channel)
    # every inline grant is still logged after its acquire, with a time no earlier
    acquired = {(r.step, r.layer, r.part): r.t for r in inline if isinstance(r, Acquire)}
    assert all(acquired[(g.step, g.layer, g.part)] <= g.t for g in inline if isinstance(g, Granted))
