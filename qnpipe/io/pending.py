"""`PendingRead`: a batch `SsdReader.start` put on the device, waited for on a file descriptor."""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from qnpipe.io.read_plan import ReadPlan, Target
from qnpipe.io.reader import ReadRequest, ReadResult
from qnpipe.io.runners import CRunner, Runner


class Reader(Protocol):
    """What a `PendingRead` asks of its `SsdReader` (its planning, judging and counting)."""

    _runner: Runner

    def _plan(self, r: ReadRequest) -> ReadPlan: ...

    def _outcome(self, plans: list[ReadPlan], which: Sequence[int], out: list[int], requests: Sequence[ReadRequest],
                 *, copied: bool) -> tuple[dict[int, str], list[int]]: ...

    def _conclude(self, requests: Sequence[ReadRequest], plans: list[ReadPlan], attempts: list[int],
                  first: dict[int, str], second: dict[int, str], dt: float) -> list[ReadResult]: ...

    def _add_stats(self, dt: float, *, requests: int, nbytes: int, bounced: int) -> None: ...


# After a batch is handed to the reader's threads, the loop's thread yields its CPU once (`PendingRead`). False:
# it goes on with its turn (A/B benchmarks): ~1-2.5 % fewer tok/s on this VM (docs/measurements.md).
_yield_after_start = True


class PendingRead:
    """A batch `SsdReader.start` put on the device, with `read_batch`'s retry and fallback rules.

    Each time the notify fd is written (and drained by the caller), `poll` takes the attempt's
    results: the batch's `ReadResult`s, `ReadError`, or None when it has put the failed reads
    on the device once more (or, refused direct I/O, buffered) and the fd will be written again.
    """

    def __init__(self, reader: Reader, requests: Sequence[ReadRequest] | Callable[[], Sequence[ReadRequest]],
                 notify_fd: int, *, at: Sequence[tuple[Target, int]] | None = None) -> None:
        self._reader = reader
        self._fd = notify_fd
        self._first: dict[int, str] | None = None  # the first attempt's failures, once known
        self._failed: dict[int, str] = {}  # this attempt's, so far (a refused read's buffered re-issue pending)
        # `at` (`SsdReader.start_at`): the requests and plans are built only if a read fails (`_planned`).
        self._at = at
        self._ask = requests
        self._requests: Sequence[ReadRequest] = ()
        self._plans: list[ReadPlan] = []
        if at is None:
            assert not callable(requests)
            self._requests = requests
            self._plans = [reader._plan(r) for r in requests]  # pyright: ignore[reportPrivateUsage]
            self._go(range(len(self._plans)))
            # At least what each read of the first attempt returns when it is whole (`poll_nbytes`'s quick
            # answer; a direct read is rounded up to whole blocks).
            self._whole = [p.op[2] for p in self._plans]
        else:
            self._which = range(len(at))
            runner = reader._runner  # pyright: ignore[reportPrivateUsage]
            assert isinstance(runner, CRunner)
            self._ops = [(t.fd, offset, t.nbytes, t.bufs) for t, offset in at]  # the plans' ops, if ever needed
            self._batch = runner.submit(self._ops, notify_fd)
            self._whole = [t.nbytes for t, _ in at]
        self._attempts = [1] * len(self._whole)
        self.t_start = time.perf_counter()  # the reads are queued (perf_counter's clock, as t_done)
        self.t_done = self.t_start  # when the device finished the last attempt
        # When a reader thread took the first read (known once polled): before t_start at times.
        self.t_started = self.t_start
        self._polled = False
        if _yield_after_start:
            # The reader thread just woken is often put on this CPU, and would wait for this thread to block
            # (a few hundred µs of the turn's work later, on this VM); a yield lets it start the reads first.
            os.sched_yield()

    def _planned(self) -> None:
        """The requests and plans of reads started `at` targets, as `start` would have planned them."""
        if self._at is None or self._plans:
            return
        assert callable(self._ask)
        self._requests = self._ask()
        self._plans = [ReadPlan(op, t.dest, 0, None, t.mode) for op, (t, _) in zip(self._ops, self._at, strict=True)]

    def _go(self, which: Sequence[int]) -> None:
        self._which = list(which)
        runner = self._reader._runner  # pyright: ignore[reportPrivateUsage]
        assert isinstance(runner, CRunner)
        ops = [p.op if p.bounce is None else (*p.op, (p.skip, p.dest)) for p in (self._plans[i] for i in which)]
        self._batch = runner.submit(ops, self._fd)

    def settle(self) -> None:
        """Block until the attempt on the device is done (then it writes nothing more)."""
        self._batch.wait()

    def poll_nbytes(self) -> list[int] | None:
        """`poll`, answered as the bytes read per request (what the live device keeps). When the first attempt
        read every request whole, the results are not built one by one: counted as `poll` counts them."""
        if self._polled or not all(map(operator.ge, self._batch.wait(), self._whole)):
            results = self.poll()
            return None if results is None else [r.nbytes for r in results]
        batch = self._batch
        self._polled = True
        self.t_started, self.t_done = batch.t_started, batch.t_done
        if self._at is None:
            nbytes = [r.nbytes for r in self._requests]
            bounced = sum(p.bounce is not None for p in self._plans)
        else:  # read in place: a target's nbytes is its requests'
            nbytes, bounced = list(self._whole), 0
        self._reader._add_stats(  # pyright: ignore[reportPrivateUsage]
            self.t_done - self.t_start, requests=len(nbytes), nbytes=sum(nbytes), bounced=bounced)
        return nbytes

    def poll(self) -> list[ReadResult] | None:
        """The results once the fd was written; None when another attempt is on its way."""
        out = self._batch.wait()  # done already: the fd is written last thing before
        self._planned()
        if not self._polled:  # the first batch put on the device
            self._polled = True
            self.t_started = self._batch.t_started
        self.t_done = self._batch.t_done
        failed, refused = self._reader._outcome(  # pyright: ignore[reportPrivateUsage]
            self._plans, self._which, out, self._requests, copied=True)
        self._failed.update(failed)
        if refused:
            self._go(refused)
            return None
        failed, self._failed = self._failed, {}
        if self._first is None:
            self._first = failed
            if failed:
                for i in failed:
                    self._attempts[i] = 2
                self._go(sorted(failed))
                return None
            second: dict[int, str] = {}
        else:
            second = failed
        return self._reader._conclude(  # pyright: ignore[reportPrivateUsage]
            self._requests, self._plans, self._attempts, self._first, second, self.t_done - self.t_start)


__all__ = ["PendingRead"]
