"""GreenletBackend: abort mid-step, early grants dropped, MTP refused, and the seam driven from trio
tasks over channels the way qnpipe.actors.forward drives a backend."""

from __future__ import annotations

from typing import Any

import greenlet
import mlx.core as mx
import numpy as np
import pytest
import trio
import trio.lowlevel
from mlx_lm.models.cache import make_prompt_cache

from qnpipe.model.family import tiny
from qnpipe.model.family.backend import GreenletBackend
from qnpipe.model.stepper import MtpRun
from qnpipe.steps import LayerRoute, PartGrant, Queued, StepDone
from tests.families.seam_pool import FakePool, drive, pool_switches, reference


def _model(family: str = "qwen3_moe", quant: str | None = "affine4") -> tuple[Any, list[list[int]], list[np.ndarray]]:
    model = tiny.build_random(tiny.tiny_config(family), quant)
    rng = np.random.default_rng(3)
    steps = [[int(t) for t in rng.integers(1, tiny.V, 30)], [4], [8]]
    return model, steps, reference(model, steps)


def test_abort_mid_step_kills_the_greenlet_and_a_fresh_step_works() -> None:
    model, steps, want = _model()
    switches = pool_switches(model)
    pool = FakePool(switches, 6, seed=2)
    be = GreenletBackend(model)
    ev = be.begin(lambda: mx.array(steps[0])[None], make_prompt_cache(model), np.array)
    assert isinstance(ev, LayerRoute)
    g = be._g
    assert g is not None and not g.dead
    be.abort()
    assert g.dead and be._g is None
    with pytest.raises(AssertionError, match="no step in progress"):
        be.resume(PartGrant(0, 1, np.zeros((1, 4), dtype=np.int64), True))
    cache = make_prompt_cache(model)
    got = [drive(be, pool, t, cache) for t in steps]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # begin aborts a step left in progress, too.
    be.begin(lambda: mx.array(steps[0])[None], make_prompt_cache(model), np.array)
    g = be._g
    cache = make_prompt_cache(model)
    got = [drive(be, pool, t, cache) for t in steps]
    assert g is not None and g.dead
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_abort_after_an_early_grant_evaluates_the_queued_work(monkeypatch: pytest.MonkeyPatch) -> None:
    model, steps, _ = _model()
    switches = pool_switches(model)
    pool = FakePool(switches, 16, seed=4, early_every=1)
    be = GreenletBackend(model)
    cache = make_prompt_cache(model)
    ev = be.begin(lambda: mx.array([3, 5])[None], cache, np.array)
    assert isinstance(ev, LayerRoute) and ev.ids.size < be.early_pairs
    grants = pool.grants(ev)
    first = next(grants)
    assert first.early and (first.slots >= 0).any()
    assert isinstance(be.resume(first), Queued)
    evaluated: list[Any] = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(a), real_eval(*a))[1])
    g = be._g
    be.abort()
    assert g is not None and g.dead
    # The queued pairs' outputs were evaluated before abort returned (their slots may be released).
    assert evaluated and all(isinstance(x, mx.array) for x in evaluated[0][0])


def test_an_exception_in_the_forward_reaches_the_caller_and_ends_the_step() -> None:
    model, steps, _ = _model("mixtral", None)
    switches = pool_switches(model)
    FakePool(switches, 4, seed=1)
    be = GreenletBackend(model)
    ev = be.begin(lambda: mx.array(steps[0])[None], make_prompt_cache(model), np.array)
    assert isinstance(ev, LayerRoute)
    with pytest.raises(ValueError, match="reshape"):  # a grant of the wrong shape
        be.resume(PartGrant(0, 1, np.zeros(0, dtype=np.int64), True))
    assert be._g is None


def test_mtp_runs_and_pipeline_parallel_are_refused() -> None:
    model, _, _ = _model("mixtral", None)
    be = GreenletBackend(model)
    run = MtpRun(None, mx.zeros((1, 1, 64)), mx.zeros((1, 1), dtype=mx.uint32), None)
    with pytest.raises(ValueError, match="MTP step runs on the native Qwen3-Next path only"):
        be.begin(lambda: run, [], np.array)
    be.ring_tail = lambda tail, cache: tail
    with pytest.raises(ValueError, match="pipeline parallel"):
        be.begin(lambda: mx.array([1])[None], [], np.array)


def test_a_pooled_switch_outside_a_step_says_so() -> None:
    model, steps, _ = _model("mixtral", None)
    FakePool(pool_switches(model), 4, seed=1)
    with pytest.raises(RuntimeError, match="inside GreenletBackend"):
        model(mx.array(steps[0])[None], cache=make_prompt_cache(model))


def test_all_resident_switches_call_mlx_lm_s_template() -> None:
    model, steps, want = _model("gpt_oss", "mxfp4")
    pool_switches(model)  # none attached
    cache = make_prompt_cache(model)
    got = [np.array(model(mx.array(t)[None], cache=cache).astype(mx.float32)) for t in steps]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(("family", "quant"), [("qwen3_moe", "affine4"), ("gpt_oss", "mxfp4"),
                                               ("deepseek_v3", None), ("qwen3_next", "affine4")])
def test_inside_trio_the_backend_and_a_pool_task_over_channels(family: str, quant: str | None) -> None:
    """The forward task drives the backend on the trio thread; the pool is another task answering
    over memory channels with a checkpoint per grant (a "read"): nothing blocks, nothing deadlocks."""
    model, steps, want = _model(family, quant)
    switches = pool_switches(model)
    pool = FakePool(switches, max(tiny.top_k(tiny.tiny_config(family)) + 1, 8), seed=9, early_every=2)
    got: list[np.ndarray] = []
    layer_steps = 0

    async def main() -> None:
        # A LayerRoute starts a layer-step, None asks for its next grant (after Queued/PartDone: the
        # pool writes a part's slots only once the part before it was computed), "end" stops.
        to_pool_send, to_pool_recv = trio.open_memory_channel[LayerRoute | str | None](0)
        grants_send, grants_recv = trio.open_memory_channel[PartGrant](0)

        async def pool_task() -> None:
            grants: Any = None
            async for msg in to_pool_recv:
                if msg == "end":
                    return
                if isinstance(msg, LayerRoute):
                    grants = pool.grants(msg)
                await trio.lowlevel.checkpoint()  # a "read"
                await grants_send.send(next(grants))

        async def forward_task() -> None:
            nonlocal layer_steps
            be = GreenletBackend(model)
            cache = make_prompt_cache(model)
            for toks in steps:
                ev = be.begin(lambda toks=toks: mx.array(toks)[None], cache, lambda y: np.array(y.astype(mx.float32)))
                while not isinstance(ev, StepDone):
                    layer_steps += isinstance(ev, LayerRoute)
                    await to_pool_send.send(ev if isinstance(ev, LayerRoute) else None)
                    ev = be.resume(await grants_recv.receive())
                got.append(ev.value)
            # A step dropped mid-layer from trio: the greenlet unwinds, the loop goes on.
            ev = be.begin(lambda: mx.array([1, 2, 3])[None], make_prompt_cache(model), np.array)
            assert isinstance(ev, LayerRoute)
            be.abort()
            await to_pool_send.send("end")

        async with trio.open_nursery() as n:
            n.start_soon(pool_task)
            n.start_soon(forward_task)

    trio.run(main)
    assert layer_steps > 0
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert greenlet.getcurrent().parent is None  # the test's own greenlet is untouched
