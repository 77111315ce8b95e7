"""Hits queued before the pool answers (qnpipe.model.speculate): exact whether confirmed or discarded.

A streamed engine with speculation gives the all-resident logits and greedy tokens bit for bit
when the speculated slots are confirmed (all hits), when a slot write lands between the queue
and the grant (the output must be discarded), and when the map is wrong (stale slots).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import qnpipe
from qnpipe.io.slot_writes import SlotWrites
from qnpipe.model.speculate import Speculation


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("spec")
    hf = make_tiny(root / "hf", layout="hf", seed=3)
    convert(hf, root / "q", bits=4, group_size=32)
    return root / "q"


PROMPT = [5, 17, 3, 99, 42, 7]


def _run(d: Path, **kw: Any) -> tuple[np.ndarray, tuple[int, ...], Any]:
    with qnpipe.Engine(d, prefill_chunk_tokens=0, **{"forward.speculate_hits": True, **kw}) as eng:
        eng.generate(PROMPT, max_tokens=6, stop_at_eos=False)  # the map learns, the pool warms
        toks = eng.generate(PROMPT, max_tokens=12, stop_at_eos=False).tokens
        logits = eng.logits([*PROMPT, *toks[:3]])
        return logits, toks, eng._aeng._rt.core.backend.spec  # pyright: ignore[reportPrivateUsage, reportOptionalMemberAccess]


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[np.ndarray, tuple[int, ...]]:
    with qnpipe.Engine(model, eager_load=True, prefill_chunk_tokens=0) as ref:
        toks = ref.generate(PROMPT, max_tokens=12, stop_at_eos=False).tokens
        return ref.logits([*PROMPT, *toks[:3]]), toks


PREFETCH = {"predict.cross_layer_prefetch": True, "pool.side_region_slots": 4}


@pytest.mark.parametrize(("slots", "more"), [(64, {}), (12, {}), (12, PREFETCH)])  # all hits, demand misses, prefetch
def test_confirmed_speculation_is_exact(model: Path, reference: tuple[np.ndarray, tuple[int, ...]],
                                        slots: int, more: dict[str, Any]) -> None:
    logits, toks, spec = _run(model, expert_slots=slots, **more)
    assert isinstance(spec, Speculation)
    if slots < 64:  # misses: reads write slots, speculation mostly discarded (early grants teach the map nothing)
        assert spec.writes.epoch > 0 and spec.writes.in_flight == 0 and spec.discarded > 0
    else:
        assert spec.confirmed > 0
    np.testing.assert_array_equal(logits, reference[0])
    assert toks == reference[1]


def test_a_slot_written_between_queue_and_grant_discards(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                         reference: tuple[np.ndarray, tuple[int, ...]]) -> None:
    slots = Speculation.slots

    def written_meanwhile(self: Speculation, layer: int, inds: mx.array) -> Any:
        got = slots(self, layer, inds)
        self.writes.begin()  # a read lands in some slot after the queue: the epoch moves on
        self.writes.end()
        return got

    monkeypatch.setattr(Speculation, "slots", written_meanwhile)
    logits, toks, spec = _run(model, expert_slots=64)
    assert spec.confirmed == 0 and spec.discarded > 0
    np.testing.assert_array_equal(logits, reference[0])
    assert toks == reference[1]


def test_a_stale_map_discards(model: Path, monkeypatch: pytest.MonkeyPatch,
                              reference: tuple[np.ndarray, tuple[int, ...]]) -> None:
    slots = Speculation.slots

    def wrong_slots(self: Speculation, layer: int, inds: mx.array) -> Any:
        got = slots(self, layer, inds)
        if got is None:
            return None
        _, host, epoch = got
        stale = np.roll(host, 1)  # every expert in another expert's slot: the graph reads the wrong weights
        return mx.maximum(mx.array(stale)[inds], 0).astype(mx.uint32), stale, epoch

    monkeypatch.setattr(Speculation, "slots", wrong_slots)
    logits, toks, spec = _run(model, expert_slots=64)
    assert spec.confirmed == 0 and spec.discarded > 0
    np.testing.assert_array_equal(logits, reference[0])
    assert toks == reference[1]


def test_speculation_is_off_by_default(model: Path) -> None:
    with qnpipe.Engine(model, expert_slots=64) as eng:
        assert eng._aeng._rt.core.backend.spec is None  # pyright: ignore[reportPrivateUsage, reportOptionalMemberAccess]


def test_no_epoch_while_a_write_is_in_flight() -> None:
    w = SlotWrites()
    assert w.quiet() == 0
    w.begin()
    assert w.quiet() is None
    w.end()
    assert w.quiet() == 1
