"""Hits answered in the forward's turn (qnpipe.actors.pool.InlinePool) log what the actors' channels would.

A real `qnpipe generate --trace` on a streamed tiny model three ways: hits run before their turn
(the default: `Forward.hit_slots` / `hit_queued`, the token read at the next step's first sync),
hits answered in the forward's turn after the backend yields (`ThreadedBackend.takes_hits` off), and
every message by channel (`qnpipe.actors.pipeline._inline_hits = False`); greedy, no autopin (its heat
would carry over) and no early grants (their records follow the reads' timing). The event logs hold
the same record kinds in the same numbers, and the same grants (step, layer, part, experts, slots,
hits, misses); only the times may differ.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qnpipe import trace
from qnpipe.actors import pipeline
from qnpipe.actors.forward import Forward
from qnpipe.actors.pool import InlinePool
from qnpipe.cli import main
from qnpipe.live.loaded import ThreadedBackend
from qnpipe.messages import Acquire, Granted, Release
from qnpipe.policy.forward_core import ForwardCore

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("inline-model")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE)
    convert(hf, root / "q")
    return root / "q"


def _run(model: Path, path: Path, slots: int, mode: str,
         monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int, int]:
    """The run's records, its inline answers and its hits run before their turn; `mode`: hits | inline | channel."""
    answered = hits = 0
    real, real_hit = InlinePool.answer, Forward.hit_queued

    def counting(self: InlinePool, msgs: Any) -> Any:
        nonlocal answered
        g = real(self, msgs)
        answered += g is not None
        return g

    def counting_hit(self: Forward, route: Any, slots: Any) -> None:
        nonlocal hits
        hits += 1
        real_hit(self, route, slots)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "_inline_hits", mode != "channel")
        if mode == "inline":
            m.setattr(ThreadedBackend, "takes_hits", property(lambda self: False))
        m.setattr(InlinePool, "answer", counting)
        m.setattr(Forward, "hit_queued", counting_hit)
        assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "6", "--json", "--temperature", "0",
                     "--set", f"pool.expert_slots={slots}", "--set", "pool.autopin=false",
                     # early grants' Present records follow the reads' real timing: not the same twice
                     "--set", "forward.early_grants=false", "--trace", str(path)]) == 0
    _, records = trace.read(path)
    return records, answered, hits


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
    first, n_first, hits = _run(streamed, tmp_path / "hits.qtrace", slots, "hits", monkeypatch)
    inline, n_inline, no_hits = _run(streamed, tmp_path / "inline.qtrace", slots, "inline", monkeypatch)
    channel, n_channel, _ = _run(streamed, tmp_path / "channel.qtrace", slots, "channel", monkeypatch)
    assert n_first >= hits > 0 and no_hits == 0 and n_inline > 0 and n_channel == 0  # each way really was taken
    kinds = Counter(type(r).__name__ for r in channel)
    assert Counter(type(r).__name__ for r in inline) == kinds
    assert Counter(type(r).__name__ for r in first) == kinds
    assert _grants(inline) == _grants(channel) == _grants(first)
    for records in (first, inline):  # every inline grant is still logged after its acquire, with a time no earlier
        acquired = {(r.step, r.layer, r.part): r.t for r in records if isinstance(r, Acquire)}
        assert all(acquired[(g.step, g.layer, g.part)] <= g.t for g in records if isinstance(g, Granted))


def test_a_stop_at_the_next_steps_first_sync_leaves_no_step(streamed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token read at the next step's first router sync ends the generation there (an EOS): that step routed
    nothing, and the pool never hears of it: the same tokens, steps and layer-steps as reading the token first."""
    import qnpipe
    from qnpipe.live.session import Output

    opts: dict[str, Any] = {"pool.autopin": False, "forward.early_grants": False}
    with qnpipe.Engine(streamed, expert_slots=16, **opts) as eng:
        full = eng.generate([5, 6, 7], max_tokens=8, stop_at_eos=False).tokens
    cut = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    real = Output.commit

    def eos_at(self: Output, tok: int) -> bool:
        return False if tok == full[cut] else real(self, tok)

    got, dropped = {}, []
    real_drop = ForwardCore.drop_step

    def counting_drop(self: ForwardCore) -> None:
        dropped.append(self.step)
        real_drop(self)

    for mode in ("hits", "inline"):
        dropped.clear()
        with monkeypatch.context() as m:
            if mode == "inline":
                m.setattr(ThreadedBackend, "takes_hits", property(lambda self: False))
            m.setattr(Output, "commit", eos_at)
            m.setattr(ForwardCore, "drop_step", counting_drop)
            with qnpipe.Engine(streamed, expert_slots=16, **opts) as eng:
                res = eng.generate([5, 6, 7], max_tokens=8)
                pool = eng.stats().pool
                assert pool is not None
                got[mode] = (res.tokens, res.stats.finish_reason, pool.steps, pool.layer_steps, pool.hits, pool.misses)
                assert len(dropped) == (mode == "hits")  # read at the next step's sync, which it then stopped
                m.setattr(Output, "commit", real)
                assert eng.generate([5, 6, 7], max_tokens=8, stop_at_eos=False).tokens == full  # the engine goes on
    assert got["hits"][0] == tuple(full[:cut])
    assert got["hits"] == got["inline"]
