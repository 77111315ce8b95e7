"""Faults and stops in the streamed engine: I/O errors, corruption, cancellation, Ctrl-C, slow devices."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import qnpipe
from qnpipe.errors import ReadError
from qnpipe.io.reader import ReaderStats, ReadRequest, ReadResult
from qnpipe.io.ssd import SsdReader
from qnpipe.io.store import ExpertStore
from tests.deadline import deadline

PROMPT = [5, 17, 300, 42, 9, 77, 11, 12, 13]
HANG_GUARD_S = 120  # only so a hang fails instead of stalling the suite; never a speed bound

def _opt(name: str, value: object) -> dict[str, Any]:
    """One dotted config field as an Engine keyword (a name keywords cannot spell)."""
    return {name: value}



class SlowReader:
    """An SsdReader that sleeps `delay_s` before each batch and records what it was asked for."""

    def __init__(self, delay_s: float = 0.0, **kw: object) -> None:
        self.inner = SsdReader(**kw)  # type: ignore[arg-type]
        self.delay_s = delay_s
        self.asked: list[tuple[int, int]] = []

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[ReadResult]:
        self.asked += [(r.layer, r.expert) for r in requests]
        time.sleep(self.delay_s)
        return self.inner.read_batch(requests)

    def statistics(self) -> ReaderStats:
        return self.inner.statistics()

    def close(self) -> None:
        self.inner.close()


def _threads() -> set[str]:
    # trio keeps idle worker threads for reuse (they hold no work); everything else must be gone.
    return {t.name for t in threading.enumerate() if not t.name.startswith("Trio thread")}


@pytest.fixture(scope="module")
def reference(streamed_models: dict[str, Path]) -> tuple[Path, np.ndarray, tuple[int, ...]]:
    d = streamed_models["default-fp32"]
    with qnpipe.Engine(d, eager_load=True) as eng:
        return d, eng.logits(PROMPT), eng.generate(PROMPT, max_tokens=24, stop_at_eos=False).tokens


@pytest.mark.slow
def test_slow_device_with_async_eval_pipelining_is_exact(reference) -> None:
    """Reads land late while MLX work is queued: route verification on, results unchanged."""
    d, want_logits, want = reference
    reader = SlowReader(delay_s=0.004, workers=4, backend="python")
    with qnpipe.Engine(d, expert_slots=4, reader=reader, prefill_chunk_tokens=3,
                       **_opt("diag.route_verify", True)) as eng:
        assert eng.generate(PROMPT, max_tokens=24, stop_at_eos=False).tokens == want
        assert np.array_equal(eng.logits(PROMPT), want_logits)
        st = eng.stats()
    assert st.pool is not None and st.pool.stall_s > 0.004 * 10  # the device really was slow


def test_injected_eio_mid_generation_raises_read_error_and_stops_everything(reference) -> None:
    d, _, _ = reference
    before = _threads()
    calls = {"n": 0}

    def flaky(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 60:
            raise OSError(errno.EIO, "injected")
        return os.preadv(fd, bufs, offset)

    reader = SsdReader(workers=2, preadv=flaky)
    eng = qnpipe.Engine(d, expert_slots=4, reader=reader)
    with deadline(30), pytest.raises(ReadError, match=r"cannot read expert \d+ of layer \d+: EIO.*file "
                                                      r".*layer_\d+\.bin, offset \d+"):
        eng.generate(PROMPT, max_tokens=40, stop_at_eos=False)  # an error, not a hang
    with pytest.raises(ReadError):  # the pipeline is down: every later call says why
        eng.generate(PROMPT, max_tokens=2)
    eng.close()
    assert _threads() <= before


def test_corrupt_record_is_caught_on_a_streamed_read(reference, tmp_path: Path) -> None:
    d, _, _ = reference
    rng = random.Random(7)
    for trial in range(3):
        copy = tmp_path / f"m{trial}"
        shutil.copytree(d, copy)
        with ExpertStore.open(copy) as store:
            layer = rng.choice(store.layers)
            lf = store.layer_file(layer)
        # Which experts does this prompt read at that layer? Corrupt one of them.
        probe = SlowReader(workers=2)
        # Autopin off: its pins would read the corrupt record at start-up, before generate.
        with qnpipe.Engine(copy, expert_slots=64, reader=probe, **_opt("pool.autopin", False)) as eng:
            eng.generate(PROMPT, max_tokens=4, stop_at_eos=False)
        expert = rng.choice(sorted({e for (ly, e) in probe.asked if ly == layer}))
        path = copy / "experts" / lf.file
        off = expert * lf.stride + rng.randrange(lf.record_nbytes)
        with path.open("r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x40]))
        with qnpipe.Engine(copy, expert_slots=64, **_opt("read.verify_crc32", True),
                           **_opt("pool.autopin", False)) as eng, \
                pytest.raises(ReadError, match=rf"expert {expert} of layer {layer}: crc32 mismatch"):
            eng.generate(PROMPT, max_tokens=4, stop_at_eos=False)


async def test_trio_cancellation_frees_the_engine_and_the_next_generate_is_exact(reference) -> None:
    d, _, want = reference
    reader = SlowReader(delay_s=0.02, workers=2)
    async with qnpipe.open_engine(d, expert_slots=4, reader=reader) as eng:
        got: list[int] = []
        with trio.move_on_after(0.3) as scope:
            await eng.generate(PROMPT, max_tokens=200, stop_at_eos=False, partial=got)
        assert scope.cancelled_caught
        # Freed when the cancelled call returns: the next call takes the engine at once, never queued behind
        # the cancelled one (a state, not a time: on 2 shared cores any wall-clock bound fails for the load).
        assert not eng._rt.lock.locked()
        stopped_at = len(got)
        reader.delay_s = 0.0
        with trio.fail_after(HANG_GUARD_S):
            nxt = await eng.generate(PROMPT, max_tokens=1, stop_at_eos=False)
        assert nxt.tokens == want[:1]
        assert len(got) == stopped_at  # the cancelled call made no token after its cancellation
        assert got == list(want[: len(got)])  # what came out before the stop is the exact prefix
        assert (await eng.generate(PROMPT, max_tokens=24, stop_at_eos=False)).tokens == want
        pool = eng.stats().pool
        assert pool is not None and pool.early_grants > 0  # steps were dropped with early work queued too


def test_keyboard_interrupt_stops_the_sync_engine_and_leaves_it_exact(reference) -> None:
    d, _, want = reference
    before = _threads()
    reader = SlowReader(delay_s=0.02, workers=2)
    with qnpipe.Engine(d, expert_slots=4, reader=reader) as eng:
        timer = threading.Timer(0.4, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        got: list[int] = []
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPT, max_tokens=500, stop_at_eos=False, partial=got)
        assert len(got) < 500  # the signal stopped the generation, not its end
        timer.join()
        assert got == list(want[: len(got)])
        reader.delay_s = 0.0
        assert eng.generate(PROMPT, max_tokens=24, stop_at_eos=False).tokens == want
    assert _threads() <= before


def test_verify_hit_bytes_catches_a_slot_that_no_longer_matches_disk(reference, tmp_path: Path) -> None:
    d, _, want = reference
    copy = tmp_path / "m"
    shutil.copytree(d, copy)
    with qnpipe.Engine(copy, expert_slots=64, **_opt("read.verify_hit_bytes", True)) as eng:
        assert eng.generate(PROMPT, max_tokens=6, stop_at_eos=False).tokens == want[:6]  # every grant compared
        # The disk changes under a resident expert: the next grant of it must notice.
        with ExpertStore.open(copy) as store:
            lf = store.layer_file(store.layers[0])
        path = copy / "experts" / lf.file
        data = bytearray(path.read_bytes())
        for e in range(lf.num_experts):
            data[e * lf.stride] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(qnpipe.errors.RouteError, match=rf"layer {store.layers[0]}: slot \d+ should hold expert"):
            eng.generate(PROMPT, max_tokens=2, stop_at_eos=False)


def test_moe_topk_override_changes_the_router_and_warns(reference) -> None:
    d, want_logits, _ = reference
    with pytest.warns(UserWarning, match="moe_topk_override=2: every router picks 2 experts instead of 4"), \
            qnpipe.Engine(d, expert_slots=8, **_opt("forward.moe_topk_override", 2)) as eng:
        got = eng.logits(PROMPT)
    assert not np.array_equal(got, want_logits)
