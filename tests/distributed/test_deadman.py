"""The deadline on a wait for another rank (the thread that ends a process stuck in MLX's ring)."""

from __future__ import annotations

import threading
import time

import pytest

from qnpipe.live.parallel.deadman import EXIT_CODE, Deadman


def test_a_wait_past_its_deadline_ends_the_process_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    exited: list[int] = []
    fired = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append(code)
        fired.set()

    d = Deadman(exit=fake_exit)
    with d.waiting(0.05, "rank 0: no answer from rank 2"):
        assert fired.wait(5)
    assert exited == [EXIT_CODE]
    assert "qnpipe: rank 0: no answer from rank 2" in capsys.readouterr().err


def test_a_wait_that_ends_in_time_or_has_no_deadline_never_fires() -> None:
    exited: list[int] = []
    d = Deadman(exit=exited.append)
    for _ in range(20):
        with d.waiting(0.2, "too slow"):
            pass
    with d.waiting(0, "no deadline"):
        time.sleep(0.3)
    time.sleep(0.3)  # past every deadline armed above
    assert exited == []
