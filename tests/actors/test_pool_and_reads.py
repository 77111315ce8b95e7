"""The pool and read-scheduler actors on trio's MockClock with a fake device: exact virtual times."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from qnpipe.actors.pipeline import open_pipeline
from qnpipe.config import Config, with_overrides
from qnpipe.errors import ReadError
from qnpipe.messages import Acquire, Granted, Present, Release
from qnpipe.policy.read_queue import Job


@attrs.define
class FakeDevice:
    """Each batch takes `latency_s` + `per_read_s` per job; records the reads in flight."""

    latency_s: float = 0.001
    per_read_s: float = 0.0
    fail_on: tuple[int, int] | None = None
    in_flight: int = 0
    peak: int = 0
    log: list[tuple[float, tuple[int, int]]] = attrs.field(factory=list)

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        self.in_flight += len(jobs)
        self.peak = max(self.peak, self.in_flight)
        await trio.sleep(self.latency_s + self.per_read_s * len(jobs))
        self.in_flight -= len(jobs)
        for j in jobs:
            if self.fail_on == (j.layer, j.expert):
                raise ReadError("injected EIO", layer=j.layer, expert=j.expert, path="fake", offset=0, nbytes=1)
            self.log.append((trio.current_time(), j.key))
        return [100] * len(jobs)

    def statistics(self) -> None:
        return None


def _cfg(workers: int = 8, batch: bool = True) -> Config:
    return with_overrides(Config(), {"read.workers": workers, "read.batch_miss_read": batch})


async def _acquire(fwd, step: int, layer: int, experts: tuple[int, ...], part: int = 0) -> Granted:
    await fwd.to_pool.send(Acquire(t=trio.current_time(), seq=0, step=step, layer=layer, part=part,
                                   experts=experts))
    return await fwd.grants.receive()


async def _release(fwd, step: int, layer: int, part: int = 0) -> None:
    await fwd.to_pool.send(Release(t=trio.current_time(), seq=0, step=step, layer=layer, part=part))


def _run(scenario, *a):
    return trio.run(scenario, *a, clock=trio.testing.MockClock(autojump_threshold=0))


def test_scripted_sequence_has_exact_virtual_times() -> None:
    dev = FakeDevice(latency_s=0.001, per_read_s=0.0005)

    async def scenario() -> list[tuple[float, int, int]]:
        out = []
        async with open_pipeline(_cfg(), None, num_experts=8, capacities={0: 3, 1: 3}, device=dev,
                                 record_nbytes={0: 100, 1: 100}) as p:
            fwd = p.forward
            g = await _acquire(fwd, 1, 0, (1, 2))  # two cold misses: one batch of 2 reads
            out.append((trio.current_time(), g.misses, g.hits))
            await _release(fwd, 1, 0)
            g = await _acquire(fwd, 1, 1, (5,))
            out.append((trio.current_time(), g.misses, g.hits))
            await _release(fwd, 1, 1)
            g = await _acquire(fwd, 2, 0, (1, 2))  # all hits: granted at once
            out.append((trio.current_time(), g.misses, g.hits))
            await _release(fwd, 2, 0)
            g = await _acquire(fwd, 2, 0, (3, 4), part=1)  # 3 slots: one of 1, 2 is evicted
            out.append((trio.current_time(), g.misses, g.hits))
            assert p.policy is not None
            assert p.policy.counters[0].evictions == 1
        return out

    got = _run(scenario)
    assert got == [(pytest.approx(0.002), 2, 0), (pytest.approx(0.0035), 1, 0), (pytest.approx(0.0035), 0, 2),
                   (pytest.approx(0.0055), 2, 0)]


def test_an_early_acquire_gets_its_experts_in_memory_first_then_the_grant() -> None:
    dev = FakeDevice(latency_s=0.001)

    async def scenario() -> list[tuple[float, object]]:
        out: list[tuple[float, object]] = []
        async with open_pipeline(_cfg(), None, num_experts=8, capacities={0: 4}, device=dev,
                                 record_nbytes={0: 100}) as p:
            fwd = p.forward
            assert fwd.to_pool is not None and fwd.grants is not None
            g = await _acquire(fwd, 1, 0, (1, 2))
            await _release(fwd, 1, 0)
            for early, step in ((True, 2), (False, 3)):  # 1, 2 resident; 5 (then 6) must be read
                new = 5 if early else 6
                await fwd.to_pool.send(Acquire(t=trio.current_time(), seq=0, step=step, layer=0, part=0,
                                               experts=(2, new, 1), early=early))
                while not isinstance(m := await fwd.grants.receive(), Granted):
                    out.append((trio.current_time(), m))
                out.append((trio.current_time(), m))
                await _release(fwd, step, 0)
            await trio.testing.wait_all_tasks_blocked()
            assert p.policy is not None and not p.policy.held and not p.policy.pending  # Present holds nothing more
            del g
        return out

    got = _run(scenario)
    (t0, present), (t1, granted), (t2, plain) = got
    assert isinstance(present, Present) and isinstance(granted, Granted) and isinstance(plain, Granted)
    # Sent at the acquire, before the read: the two experts in memory, in their grant slots.
    assert t0 == pytest.approx(0.001) and t1 == pytest.approx(0.002) and t2 == pytest.approx(0.003)
    assert present.experts == (2, 1)
    slot_of = dict(zip(granted.experts, granted.slots, strict=True))
    assert present.slots == (slot_of[2], slot_of[1])
    assert (granted.hits, granted.misses) == (2, 1)


def test_an_early_acquire_gets_each_burst_of_landed_reads_before_the_grant() -> None:
    dev = FakeDevice(latency_s=0.001)

    async def scenario() -> list[tuple[float, object]]:
        out: list[tuple[float, object]] = []
        # One read on the device at a time: each miss lands on its own, 1 ms apart.
        async with open_pipeline(_cfg(workers=1), None, num_experts=8, capacities={0: 4}, device=dev,
                                 record_nbytes={0: 100}) as p:
            fwd = p.forward
            assert fwd.to_pool is not None and fwd.grants is not None
            await _acquire(fwd, 1, 0, (1, 2))
            await _release(fwd, 1, 0)
            t0 = trio.current_time()
            await fwd.to_pool.send(Acquire(t=t0, seq=0, step=2, layer=0, part=0, experts=(2, 5, 1, 6), early=True))
            while not isinstance(m := await fwd.grants.receive(), Granted):
                out.append((trio.current_time() - t0, m))
            out.append((trio.current_time() - t0, m))
            await _release(fwd, 2, 0)
        return out

    got = _run(scenario)
    assert [type(m).__name__ for _, m in got] == ["Present", "Present", "Granted"]
    (t_hits, hits), (t_five, five), (t_all, granted) = got
    assert isinstance(hits, Present) and isinstance(five, Present) and isinstance(granted, Granted)
    assert hits.experts == (2, 1) and five.experts == (5,)
    assert (t_hits, t_five, t_all) == (pytest.approx(0.0), pytest.approx(0.001), pytest.approx(0.002))
    slot_of = dict(zip(granted.experts, granted.slots, strict=True))
    assert hits.slots == (slot_of[2], slot_of[1]) and five.slots == (slot_of[5],)
    assert (granted.hits, granted.misses) == (2, 2)


@attrs.define
class SubmitDevice(FakeDevice):
    """A device that starts its reads when submitted (as `StoreDevice` does), noting which task submitted."""

    by_task: list[tuple[str, bool]] = attrs.field(factory=list)  # (its name, whether it holds a nursery)

    def submit(self, jobs: Sequence[Job]):
        task = trio.lowlevel.current_task()
        self.by_task.append((task.name, bool(task.child_nurseries)))
        return self.read(jobs)


@pytest.mark.parametrize("inline", [True, False], ids=["in-the-pools-turn", "by-channel"])
def test_reads_go_on_the_device_in_a_turn(monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    # In the read scheduler's turn, taken by the scheduler's own task or (live, the scheduler idle) in the
    # pool's turn: never in a task started for it, which would run a scheduler batch later (after, at random,
    # the forward's work on an early grant).
    from qnpipe.actors import pipeline

    monkeypatch.setattr(pipeline, "_inline_reads", inline)
    dev = SubmitDevice(latency_s=0.001)

    async def scenario() -> None:
        async with open_pipeline(_cfg(), None, num_experts=64, capacities={0: 4}, device=dev,
                                 record_nbytes={0: 100}) as p:
            for step in range(1, 4):
                g = await _acquire(p.forward, step, 0, (step, 10 + step))
                assert g.misses == 2
                await _release(p.forward, step, 0)

    _run(scenario)
    # an actor's own task (not one the scheduler started); the read scheduler's holds its nursery, the pool's none
    actor = "pool_actor" if inline else "supervised"  # the pool's task runs under its own wrapper
    assert dev.by_task == [(f"qnpipe.actors.pipeline._open_actors.<locals>.{actor}", not inline)] * 3


def test_an_early_acquire_all_in_memory_or_all_missing_gets_only_the_grant() -> None:
    async def scenario() -> list[str]:
        kinds = []
        async with open_pipeline(_cfg(), None, num_experts=8, capacities={0: 4}, device=FakeDevice(),
                                 record_nbytes={0: 100}) as p:
            fwd = p.forward
            assert fwd.to_pool is not None and fwd.grants is not None
            for step, experts in ((1, (1, 2)), (2, (1, 2)), (3, (3, 4))):
                await fwd.to_pool.send(Acquire(t=trio.current_time(), seq=0, step=step, layer=0, part=0,
                                               experts=experts, early=True))
                kinds.append(type(await fwd.grants.receive()).__name__)
                await _release(fwd, step, 0)
        return kinds

    assert _run(scenario) == ["Granted", "Granted", "Granted"]


def test_duplicate_waits_merge_into_one_read_and_budget_holds() -> None:
    dev = FakeDevice(latency_s=0.001)

    async def scenario() -> tuple[int, int]:
        async with open_pipeline(_cfg(workers=2), None, num_experts=64, capacities={0: 64}, device=dev,
                                 record_nbytes={0: 100}) as p:
            g = await _acquire(p.forward, 1, 0, tuple(range(10)))
            assert g.misses == 10
            # 10 reads through a budget of 2: 5 batches of 1 ms
            assert trio.current_time() == pytest.approx(0.005)
            assert p.read_stats is not None
            return dev.peak, p.read_stats.reads

    peak, reads = _run(scenario)
    assert peak == 2 and reads == 10


def test_full_load_cycle_does_not_deadlock() -> None:
    """Many layers, every access a miss at capacity == top-k: the pool <-> reads cycle at full load."""
    dev = FakeDevice(latency_s=0.0001)
    layers = 16

    async def scenario() -> int:
        steps = 0
        async with open_pipeline(_cfg(workers=3, batch=False), None, num_experts=64,
                                 capacities=dict.fromkeys(range(layers), 4), device=dev,
                                 record_nbytes=dict.fromkeys(range(layers), 100)) as p:
            with trio.fail_after(60):
                for step in range(1, 40):
                    for layer in range(layers):
                        experts = tuple(sorted({(step * 7 + layer * 3 + i * 11) % 64 for i in range(4)}))
                        g = await _acquire(p.forward, step, layer, experts)
                        assert set(g.experts) == set(experts)
                        await _release(p.forward, step, layer)
                        steps += 1
        return steps

    assert _run(scenario) == 39 * layers
    assert dev.peak <= 3


def test_read_error_reaches_the_forward_and_stops_the_actors() -> None:
    dev = FakeDevice(fail_on=(0, 3))

    async def scenario() -> None:
        async with open_pipeline(_cfg(), None, num_experts=8, capacities={0: 4}, device=dev,
                                 record_nbytes={0: 100}) as p:
            fwd = p.forward
            assert fwd.to_pool is not None and fwd.grants is not None
            await _acquire(fwd, 1, 0, (1, 2))
            await _release(fwd, 1, 0)
            await fwd.to_pool.send(Acquire(t=0.0, seq=0, step=2, layer=0, part=0, experts=(3,)))
            with pytest.raises(trio.EndOfChannel):
                await fwd.grants.receive()
            assert len(fwd.failure) == 1 and isinstance(fwd.failure[0], ReadError)
            assert "expert 3 of layer 0" in str(fwd.failure[0])

    _run(scenario)


def test_watchdog_turns_a_hung_device_into_a_stall_error_with_the_evidence() -> None:
    from qnpipe.errors import StallError
    from qnpipe.steps import LayerRoute

    class OneLayer:
        async def begin(self, inputs: object, cache: object, tail: object) -> LayerRoute:
            return LayerRoute(0, np.array([[1, 2]]))

        async def resume(self, grant: object) -> object:
            raise AssertionError("the device never answers, so no grant comes")

        async def abort(self) -> None:
            pass

    cfg = with_overrides(Config(), {"diag.watchdog_s": 2.0})

    async def scenario() -> float:
        async with open_pipeline(cfg, OneLayer(), num_experts=8, capacities={0: 4},
                                 device=FakeDevice(latency_s=math.inf), record_nbytes={0: 100}) as p:
            with pytest.raises(StallError, match=r"no progress for 2\.\d s .*pending \[\(1, 0, 0\)\].*in flight"):
                await p.forward.run(None, None, lambda h: None)
            return trio.current_time()

    assert _run(scenario) < 3.0  # within a check interval of the limit, on the virtual clock


@pytest.mark.parametrize("shields", [True, False])
def test_a_batch_claimed_by_another_task_ends_with_the_read_scheduler(shields: bool) -> None:
    """A demand batch a task claimed (`ReadsInline.take`'s `claim`) and waits for itself ends when the read
    scheduler stops, as the actor's own wait would: None at once when the device's wait can be cancelled, None
    once the read is done when the device shields it (`shields_reads`: its reads write into slot memory)."""
    from qnpipe.actors.read_scheduler import Claimed, ReadSchedulerStats, ReadsInline, read_scheduler
    from qnpipe.messages import ReadExperts
    from qnpipe.policy.read_core import read_queue

    class Device:
        shields_reads = shields
        done = 0

        async def read(self, jobs: Sequence[Job]) -> list[int]:
            with trio.CancelScope(shield=shields):
                await trio.sleep(5)
            self.done += 1
            return [100] * len(jobs)

        def statistics(self) -> None:
            return None

    dev = Device()

    async def scenario() -> tuple[object, float]:
        inbox_tx, inbox_rx = trio.open_memory_channel[object](8)
        pool_tx, pool_rx = trio.open_memory_channel[object](8)
        inline = ReadsInline(inbox_rx)  # type: ignore[arg-type]
        got: list[object] = []
        async with inbox_tx, pool_rx, trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def actor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await read_scheduler(inbox_rx, pool_tx, device=dev,  # type: ignore[arg-type]
                                         queue=read_queue(Config()), stats=ReadSchedulerStats(), inline=inline,
                                         task_status=task_status)

            await nursery.start(actor)
            claim: list[Claimed] = []
            assert inline.take([ReadExperts(t=0.0, seq=1, layer=0, experts=(1,), slots=(0,))], claim)
            assert len(claim) == 1 and inline.claimed == 1

            async def wait() -> None:
                got.append(await inline.reads_of(claim[0]))
                got.append(trio.current_time())

            nursery.start_soon(wait)
            await trio.sleep(1)
            scope.cancel()
        return got[0], got[1]  # type: ignore[return-value]

    nbytes, t = _run(scenario)
    assert nbytes is None
    assert (t, dev.done) == ((5.0, 1) if shields else (1.0, 0))
