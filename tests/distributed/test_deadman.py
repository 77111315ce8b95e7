"""The deadline on a wait for another rank (the thread that ends a process stuck in MLX's ring).

The deadman reads its own clock (`time.monotonic` in its module); here that clock is the test's,
moved by hand, so "in time" and "past the deadline" are facts of the test, not of the machine's load.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from qnpipe.live.parallel import deadman
from qnpipe.live.parallel.deadman import EXIT_CODE, Deadman

HANG_S = 30  # a hang guard only: each wait below ends on an event
LOOK_S = 0.5  # time for the deadman to look at a stale deadline (it looks every 0.1 s here)


class Clock:
    """The deadman's clock: stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(deadman, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def test_a_wait_past_its_deadline_ends_the_process_saying_why(clock: Clock,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    exited: list[int] = []
    fired = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append(code)
        fired.set()

    d = Deadman(exit=fake_exit)
    with d.waiting(0.05, "rank 0: no answer from rank 2"):
        assert not fired.is_set()
        clock.now = 0.06
        assert fired.wait(HANG_S)
    assert exited == [EXIT_CODE]
    assert "qnpipe: rank 0: no answer from rank 2" in capsys.readouterr().err


def test_a_wait_that_ends_in_time_or_has_no_deadline_never_fires(clock: Clock,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    exited: list[int] = []
    fired = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append(code)
        fired.set()

    d = Deadman(exit=fake_exit)
    for _ in range(20):
        with d.waiting(0.2, "too slow"):
            clock.now += 0.1  # each block takes half its deadline
    with d.waiting(0, "no deadline"):
        clock.now += 1000
    # Past every deadline armed above. A deadline left armed would fire at the deadman's next look,
    # at most 0.1 s (its last deadline's distance on this clock) away; a correct deadman never fires,
    # so a busy machine can only hide a bug here, never fail the test.
    assert not fired.wait(LOOK_S)
    # The deadman is still watching: the next wait that overruns fires, and it is the only one that does.
    with d.waiting(1, "the last"):
        clock.now += 2
        assert fired.wait(HANG_S)
    assert exited == [EXIT_CODE]
    err = capsys.readouterr().err
    assert "the last" in err and "too slow" not in err and "no deadline" not in err
