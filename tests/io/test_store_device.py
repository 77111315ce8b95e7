"""The live device's submitter (qnpipe/io/device.py): batches on the device at once run at once."""

from __future__ import annotations

import threading

import trio

from qnpipe.io.device import Submitter


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
