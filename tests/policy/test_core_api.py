"""Every sans-IO core answers one way: `handle(msg, now) -> Outbox`, `end_turn(now) -> Outbox`,
`statistics()` a frozen snapshot, and a message it does not know is refused, never ignored."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pytest

from qnpipe.config import load
from qnpipe.messages import Acquire, Candidates, Granted, PrefetchHint, Promote, ReadExperts
from qnpipe.policy.build import make_policy
from qnpipe.policy.forward_core import ForwardCore
from qnpipe.policy.hinter import Hinter, PredictorStatistics
from qnpipe.policy.outbox import Core, Outbox
from qnpipe.policy.pool_core import PoolCore
from qnpipe.policy.read_core import ReadCore, read_queue

CORES = (PoolCore, ReadCore, ForwardCore, Hinter)


def core_shape_violations(cls: type) -> list[str]:
    """What in `cls` breaks the one core API (an empty list: none)."""
    bad = []
    for name, params in (("handle", ["self", "msg", "now"]), ("end_turn", ["self", "now"]), ("statistics", ["self"])):
        fn = getattr(cls, name, None)
        if fn is None:
            bad.append(f"{cls.__name__} has no {name}")
            continue
        sig = inspect.signature(fn)
        if list(sig.parameters) != params:
            bad.append(f"{cls.__name__}.{name}{sig}: parameters {params[1:]} wanted")
        if name != "statistics" and sig.return_annotation not in ("Outbox", Outbox):
            bad.append(f"{cls.__name__}.{name} returns {sig.return_annotation}, not an Outbox")
    handle = getattr(cls, "handle", None)
    if handle is not None:
        src = inspect.getsource(handle)
        if "self._handle(msg, now, out)" in src:  # the dispatch `handle` and `turn` share
            src = inspect.getsource(getattr(cls, "_handle", handle))
        if "match msg" not in src or "assert_never(msg)" not in src:
            bad.append(f"{cls.__name__}.handle: dispatch is not a match ending in assert_never")
    return bad


def cores() -> list[Any]:
    cfg = load(None)
    policy = make_policy(cfg, {0: 4}, {0: 100})
    return [PoolCore(policy), ReadCore(read_queue(cfg)), ForwardCore({0: 4}, 8, {0: 0}), Hinter(cfg.predict, 4)]


def test_every_core_has_the_one_api() -> None:
    assert [v for cls in CORES for v in core_shape_violations(cls)] == []
    typed: list[Core] = cores()  # pyright checks each against the protocol
    assert len(typed) == len(CORES)


def test_the_api_check_names_a_made_up_violation() -> None:
    class Delegates:  # `handle` hands over to an `_handle` that is an isinstance chain
        def handle(self, msg: Any, now: float) -> Outbox:
            out = Outbox()
            self._handle(msg, now, out)
            return out

        def _handle(self, msg: Any, now: float, out: Outbox) -> None:
            if isinstance(msg, Acquire):
                out.pool.append(msg)

    assert any("not a match ending in assert_never" in v for v in core_shape_violations(Delegates))

    class Listy:
        def handle(self, msg: Any, now: float, out: Outbox) -> None:
            if isinstance(msg, Acquire):
                out.pool.append(msg)

        def dispatch(self, now: float) -> list[int]:
            return []

    found = core_shape_violations(Listy)
    assert any(v.startswith("Listy.handle(") and v.endswith("wanted") for v in found)
    assert any("returns None, not an Outbox" in v for v in found)
    assert any("has no end_turn" in v for v in found) and any("no statistics" in v for v in found)
    assert any("not a match ending in assert_never" in v for v in found)


@pytest.mark.parametrize("i", range(len(CORES)))
def test_a_core_refuses_a_message_it_does_not_know(i: int) -> None:
    core = cores()[i]
    alien: Any = Candidates(t=0.0, seq=1, step=1, layer=0, target=0, width=1, token_experts=(0,),
                            token_scores=(1.0,), deadline=0.0)  # the predictor's inbox: no other core takes it
    if isinstance(core, Hinter):
        alien = Promote(t=0.0, seq=1, layer=0, expert=0)
    with pytest.raises(AssertionError):
        core.handle(alien, 0.0)


@pytest.mark.parametrize("i", range(len(CORES)))
def test_a_cores_statistics_are_a_frozen_snapshot(i: int) -> None:
    core = cores()[i]
    snap = core.statistics()
    field = attrs.fields(type(snap))[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(snap, field, 1)


def test_answers_are_returned_not_appended() -> None:
    pool, reads, _, _ = cores()
    out = pool.handle(Acquire(t=0.0, seq=1, step=1, layer=0, part=0, experts=(3,)), 0.0)
    assert isinstance(out, Outbox) and isinstance(out.reads[0], ReadExperts) and out.forward == []
    assert pool.end_turn(0.0) == Outbox()
    assert reads.handle(out.reads[0], 0.0).batches == []  # queued; the turn's end puts it on the device
    started = reads.end_turn(0.0)
    assert [(j.layer, j.expert) for b in started.batches for j in b.jobs] == [(0, 3)]
    assert reads.handle(Promote(t=0.0, seq=2, layer=0, expert=3), 0.0) == Outbox()
    assert reads.statistics().requests == 1


def test_a_turn_answers_as_its_messages_and_end_turn_do_one_by_one() -> None:
    def acquire(seq: int, expert: int) -> Acquire:
        return Acquire(t=0.0, seq=seq, step=seq, layer=0, part=0, experts=(expert,), early=seq == 2)

    one_by_one, whole = cores()[0], cores()[0]
    one_by_one.logging = whole.logging = True
    msgs = [acquire(1, 3), acquire(2, 5)]
    expected = Outbox()
    for m in msgs:
        expected.extend(one_by_one.handle(m, 0.0))
    expected.extend(one_by_one.end_turn(0.0))
    got = whole.turn(msgs, 0.0)
    assert got == expected and len(got.reads) == 2 and got.log
    reads, reads2 = cores()[1], cores()[1]
    sent = [r for r in got.reads if isinstance(r, ReadExperts)]
    expected = Outbox()
    for r in sent:
        expected.extend(reads.handle(r, 0.0))
    expected.extend(reads.end_turn(0.0))
    assert reads2.turn(sent, 0.0) == expected and expected.batches
    hinter, hinter2 = cores()[3], cores()[3]
    c = Candidates(t=0.0, seq=1, step=1, layer=0, target=0, width=1, token_experts=(2,), token_scores=(1.0,),
                   deadline=1.0)
    assert hinter2.turn([c, c], 0.0) == hinter.handle(c, 0.0).extend(hinter.handle(c, 0.0)).extend(
        hinter.end_turn(0.0))


def test_the_old_import_path_of_outbox_works() -> None:
    from qnpipe.policy.pool_core import Outbox as Old

    assert Old is Outbox


def test_the_forward_core_drops_a_grant_of_a_cancelled_step_and_refuses_one_it_never_asked_for() -> None:
    core = ForwardCore({0: 4}, 8, {0: 0})
    core.begin_step()
    out = core.route(0, [1, 2], 2, 0.0)
    assert [type(m).__name__ for m in out.pool] == ["Acquire"]
    assert [type(m).__name__ for m in core.cancel(0.0).pool] == ["Release"]
    core.begin_step()
    core.route(0, [1, 2], 2, 1.0)
    late = Granted(t=1.0, seq=9, step=1, layer=0, part=0, experts=(1, 2), slots=(0, 1), generations=(1, 1), hits=2,
                   misses=0, waited_s=0.0)
    assert core.handle(late, 1.0).run is None  # the pool had its Release
    wrong = Granted(t=1.0, seq=10, step=2, layer=0, part=1, experts=(1, 2), slots=(0, 1), generations=(1, 1),
                    hits=2, misses=0, waited_s=0.0)
    with pytest.raises(AssertionError, match=r"grant \(2, 0, 1\) while waiting for \(2, 0, 0\)"):
        core.handle(wrong, 1.0)
    right = Granted(t=2.0, seq=11, step=2, layer=0, part=0, experts=(1, 2), slots=(3, 1), generations=(1, 1),
                    hits=0, misses=2, waited_s=0.5)
    run = core.handle(right, 2.5).run
    assert run is not None and run.last and run.slots.tolist() == [[3, 1]] and core.stats.stall_s == 1.5
    assert [type(m).__name__ for m in core.part_done(3.0).pool] == ["Release"]


def test_the_predictor_core_sends_what_the_pools_inbox_has_room_for_and_counts_the_rest() -> None:
    hinter = Hinter(load(None).predict, 2)

    def cands(step: int) -> Candidates:
        return Candidates(t=0.0, seq=step, step=step, layer=0, target=1, width=2, token_experts=(3, 5),
                          token_scores=(0.7, 0.3), deadline=1.0)

    hinter.room = 1
    sent = [hinter.handle(cands(1), 0.0).pool, hinter.handle(cands(2), 0.0).pool]
    assert all(isinstance(h, PrefetchHint) for p in sent for h in p)
    assert [[(h.layer, h.experts) for h in p if isinstance(h, PrefetchHint)] for p in sent] == [[(1, (3, 5))], []]
    assert hinter.statistics() == PredictorStatistics(candidates=2, hints=1, hints_dropped_full=1, experts_hinted=2)
    assert hinter.end_turn(0.0) == Outbox()
