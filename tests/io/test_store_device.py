"""The live device (qnpipe/io/device.py): its submitter runs batches on the device at once together; reads put
on the reader's threads from the loop, or handed to a submitter thread, fill the slots alike."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import trio

from qnpipe.io import device
from qnpipe.io.device import StoreDevice, Submitter
from qnpipe.io.ssd import SsdReader, c_extension_available
from qnpipe.io.store import ExpertStore
from qnpipe.messages import Job


def test_a_batch_does_not_wait_for_one_already_on_the_device() -> None:
    # The read scheduler puts a demand batch on the device while a prefetch batch is still
    # being read; the demand's reads must start now, not when the prefetches are done.
    sub = Submitter()
    second_ran = threading.Event()

    def first() -> bool:
        return second_ran.wait(timeout=10)  # False: the second batch only ran after this one

    def second() -> str:
        second_ran.set()
        return "second"

    async def main() -> tuple[bool, str]:
        a = sub.start(first)
        b = sub.start(second)
        return await a, await b

    try:
        assert trio.run(main) == (True, "second")
    finally:
        sub.close()


def test_close_joins_every_thread_and_an_error_reaches_the_caller() -> None:
    sub = Submitter()

    def boom() -> None:
        raise OSError(5, "EIO")

    async def main() -> str:
        try:
            await sub.start(boom)
        except OSError as e:
            return str(e)
        return "no error"

    before = threading.active_count()
    assert trio.run(main) == "[Errno 5] EIO"
    assert threading.active_count() == before + Submitter.THREADS
    sub.close()
    assert threading.active_count() == before
    assert not any(t.name == "qnpipe-read-submit" and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------------------- StoreDevice, both ways


@pytest.mark.skipif(not c_extension_available(), reason="C extension not built")
@pytest.mark.parametrize("start", ["at", "start", "thread"])
def test_the_device_fills_slots_alike_either_way(tmp_path, monkeypatch, start) -> None:
    # Reads put on the reader's threads from the loop (`SsdReader.start`, woken by a descriptor the
    # reader writes), or each batch on a submitter thread: the same bytes in the same slots.
    from test_reader import BIG_RECORD, BIG_TENSORS, _check_slots, _pool, write_store

    index = write_store(tmp_path, layers=2, experts=6, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    pools = [_pool(lf, 4) for lf in index.layers]
    monkeypatch.setattr(device, "_start_reads", start != "thread")
    monkeypatch.setattr(device, "_in_place", start == "at")
    rng = np.random.default_rng(3)

    def batch() -> list[Job]:
        layer = int(rng.integers(2))
        return [Job(layer=layer, expert=int(e), slot=s) for s, e in enumerate(rng.choice(6, 3, replace=False))]

    async def main(dev: StoreDevice) -> None:
        for _ in range(20):
            jobs = batch()
            assert await device.submit(dev, jobs) == [BIG_RECORD] * 3
            _check_slots(tmp_path, index, [(j.layer, j.expert) for j in jobs], pools, [j.slot for j in jobs])
        async with trio.open_nursery() as nursery:  # batches at once, each with its own wake-up
            for layer in (0, 1):
                jobs = [Job(layer=layer, expert=e, slot=e % 4) for e in (layer, layer + 2)]
                nursery.start_soon(_await, device.submit(dev, jobs))
        _check_slots(tmp_path, index, [(0, 0), (0, 2), (1, 1), (1, 3)], pools, [0, 2, 1, 3])

    async def _await(reading) -> None:
        await reading

    with ExpertStore.open(tmp_path) as store, SsdReader(workers=2, backend="c") as reader:
        dev = StoreDevice(store, reader, lambda layer, slot: {n: a[slot] for n, a in pools[layer].items()},
                          verify_crc32=False)
        try:
            asked = []
            request = dev.request
            dev.request = lambda job: asked.append(job) or request(job)  # pyright: ignore[reportAttributeAccessIssue]
            trio.run(main, dev)
            stats = reader.statistics()
            pairs = set(dev._wakeups._open)  # pyright: ignore[reportPrivateUsage]
        finally:
            dev.close()
    assert stats.batches == 22 and stats.bounced_reads == 0
    # one wake-up pair reused batch after batch, a second for the batch on the device beside it; closed with it
    assert len(pairs) == (0 if start == "thread" else 2)
    # at targets, a request is built once per slot (its target), not per read
    slots = {(j.layer, j.slot) for j in asked}
    assert len(asked) == (len(slots) if start == "at" else 20 * 3 + 4) and len(slots) == 7
    for pair in pairs:
        for fd in pair:
            with pytest.raises(OSError):
                os.fstat(fd)


@pytest.mark.skipif(not c_extension_available(), reason="C extension not built")
def test_reads_at_targets_check_the_expert_and_plan_again_after_a_fallback(tmp_path) -> None:
    from test_reader import BIG_RECORD, BIG_TENSORS, _check_slots, _pool, write_store

    from qnpipe.errors import StoreError

    index = write_store(tmp_path, layers=1, experts=6, record_nbytes=BIG_RECORD, tensors=BIG_TENSORS)
    pools = [_pool(lf, 4) for lf in index.layers]

    async def main(dev: StoreDevice, reader: SsdReader) -> None:
        assert await device.submit(dev, [Job(layer=0, expert=1, slot=2)]) == [BIG_RECORD]
        with pytest.raises(StoreError, match="expert 6 out of range"):  # the slot's target is known already
            device.submit(dev, [Job(layer=0, expert=6, slot=2)])
        planned = dev._targets[(0, 2)][0]  # pyright: ignore[reportPrivateUsage]
        reader.epoch += 1  # as a file reopened through the page cache does
        assert await device.submit(dev, [Job(layer=0, expert=4, slot=2)]) == [BIG_RECORD]
        again = dev._targets[(0, 2)][0]  # pyright: ignore[reportPrivateUsage]
        assert again is not planned and again.epoch == reader.epoch
        _check_slots(tmp_path, index, [(0, 4)], pools, [2])

    with ExpertStore.open(tmp_path) as store, SsdReader(workers=2, backend="c") as reader:
        dev = StoreDevice(store, reader, lambda layer, slot: {n: a[slot] for n, a in pools[layer].items()},
                          verify_crc32=False)
        try:
            trio.run(main, dev, reader)
        finally:
            dev.close()
