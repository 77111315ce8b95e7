"""`ForwardCore.hold_last_release`: a layer-step's last `Release` goes with the next message, never lost.

Both drivers hold it (the live forward with inline hits, replay's heap driver), so the forward's
acquire finds the pool's inbox empty; a cancelled step still releases it, before its own part.
"""

from __future__ import annotations

from qnpipe.messages import Acquire, ForwardDone, Granted, Release
from qnpipe.policy.forward_core import ForwardCore


def _grant(step: int, layer: int, experts: tuple[int, ...]) -> Granted:
    return Granted(t=0.0, seq=1, step=step, layer=layer, part=0, experts=experts,
                   slots=tuple(range(len(experts))), generations=(1,) * len(experts), hits=len(experts), misses=0,
                   waited_s=0.0)


def _kinds(msgs: list) -> list[tuple[str, int]]:
    return [(type(m).__name__, m.layer if isinstance(m, Acquire | Release) else -1) for m in msgs]


def test_the_last_release_goes_with_the_next_acquire_then_with_forward_done() -> None:
    core = ForwardCore({0: 4, 1: 4}, 8, {0: 0, 1: 1}, hold_last_release=True)
    core.begin_step()
    assert _kinds(core.route(0, [1, 2], 2, 0.0).pool) == [("Acquire", 0)]
    assert core.handle(_grant(1, 0, (1, 2)), 0.0).run is not None
    assert core.part_done(1.0).pool == []  # held
    out = core.route(1, [3, 4], 2, 1.0)
    assert _kinds(out.pool) == [("Release", 0), ("Acquire", 1)]
    assert out.pool[0].t == 1.0  # stamped when the part was done
    core.handle(_grant(1, 1, (3, 4)), 1.0)
    assert core.part_done(2.0).pool == []
    done = core.end_step(2.0).pool
    assert _kinds(done) == [("Release", 1), ("ForwardDone", -1)] and isinstance(done[1], ForwardDone)


def test_a_cancelled_step_releases_the_held_part_before_its_own() -> None:
    core = ForwardCore({0: 4, 1: 4}, 8, {0: 0, 1: 1}, hold_last_release=True)
    core.begin_step()
    core.route(0, [1, 2], 2, 0.0)
    core.handle(_grant(1, 0, (1, 2)), 0.0)
    assert core.part_done(1.0).pool == []
    assert _kinds(core.cancel(1.0).pool) == [("Release", 0)]  # held, nothing else acquired
    assert core.cancel(1.0).pool == []  # given once


def test_without_it_each_release_goes_at_once() -> None:
    core = ForwardCore({0: 4}, 8, {0: 0})
    core.begin_step()
    core.route(0, [1, 2], 2, 0.0)
    core.handle(_grant(1, 0, (1, 2)), 0.0)
    assert _kinds(core.part_done(1.0).pool) == [("Release", 0)]
