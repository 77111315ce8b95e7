"""Issue 34 item 8 (plug-in hangs): a plug-in whose `pick` never returns no longer freezes `qnpipe`.

The plug-in runs on the pipeline's loop thread, so neither the stall watchdog task nor the
engine's close could run, and SIGINT / SIGTERM were ignored. Now the hang guard
(qnpipe.hang_guard) stops the process: at once after a signal the loop cannot act on within
STOP_GRACE_S, and after `diag.watchdog_s` with no signal; the message names the plug-in and
its method, the exit status is 128 + the signal (2 for the watchdog). A sweep point over its
time limit (`--point-timeout`) is killed and reported as its own failure; the others complete.

Each process is waited for with a timeout that is a hang guard only (no timed assert). The
plug-in sleeps in `pick` once it has answered HP_AFTER picks, after touching HP_MARK: the
signal goes once the process is inside the sleep.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_harness import MEM_LIMIT, clean_env
from plugin_lru import LRU_SOURCE

from qnpipe.replay.synth import SynthSpec, write_synth

PLUGIN = LRU_SOURCE + '''
import itertools
import os
import pathlib
import time

_picks = itertools.count()


class Sleep(LRUish):
    """Least recently used, until pick number HP_AFTER: that one touches HP_MARK and sleeps for good."""

    def pick(self, loading, held, pinned, incoming):
        if next(_picks) >= int(os.environ.get("HP_AFTER", "0")):
            pathlib.Path(os.environ["HP_MARK"]).touch()
            time.sleep(10**6)
        return super().pick(loading, held, pinned, incoming)


class Spin(Sleep):
    def pick(self, loading, held, pinned, incoming):
        pathlib.Path(os.environ["HP_MARK"]).touch()
        while True:
            pass
'''
MODULE = "hp_hang"
START_S = 120.0  # hang guard: import MLX, load the demo model, reach the plug-in's sleep
STOP_S = 60.0  # hang guard: from the signal to the exit (the guard's own bound is 2 s)
REC = "replay.record_nbytes=100000"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hang")
    (root / f"{MODULE}.py").write_text(PLUGIN)
    write_synth(root / "r.qtrace", SynthSpec(layers=2, experts=16, top_k=2, tokens=20, seed=1))
    return root


def _env(d: Path, mark: Path, after: int) -> dict[str, str]:
    import qnpipe

    return clean_env() | {"PYTHONPATH": f"{Path(qnpipe.__file__).parents[1]}:{d}", "HP_MARK": str(mark),
                          "HP_AFTER": str(after)}


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))


@contextmanager
def _started(argv: list[str], env: dict[str, str], err: Path) -> Iterator[subprocess.Popen[bytes]]:
    with err.open("wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "qnpipe", *argv], stdout=subprocess.DEVNULL, stderr=f, env=env,
                             preexec_fn=_limit)
    try:
        yield p
    finally:
        if p.poll() is None:  # only this test's own process, by its handle
            p.kill()
            p.wait()


def _stopped(argv: list[str], d: Path, name: str, sig: signal.Signals | None, after: int) -> tuple[int | None, str]:
    """Run `qnpipe argv`; once the plug-in sleeps, send `sig` (None: send nothing); (exit status, stderr).

    The status is None when the plug-in never slept or the process did not end (the hang guards)."""
    mark, err = d / f"{name}.mark", d / f"{name}.err"
    mark.unlink(missing_ok=True)
    with _started(argv, _env(d, mark, after), err) as p:
        until = time.monotonic() + START_S
        while not mark.exists() and p.poll() is None and time.monotonic() < until:
            time.sleep(0.05)
        if not mark.exists():
            return None, f"the plug-in never slept: {err.read_text()}"
        time.sleep(0.3)  # inside the sleep, not about to enter it
        if sig is not None:
            p.send_signal(sig)
        try:
            return p.wait(timeout=STOP_S), err.read_text()
        except subprocess.TimeoutExpired:
            return None, f"still running {STOP_S} s after {sig.name if sig else 'the stall'}: {err.read_text()}"


def _check(name: str, rc: int | None, err: str, want: int, needles: tuple[str, ...]) -> list[str]:
    if rc is None:
        return [f"{name}: {err[-800:]}"]
    problems = []
    if rc != want:
        problems.append(f"exit {rc}, expected {want}")
    if "Traceback" in err:
        problems.append("traceback")
    if missing := [n for n in needles if n not in err]:
        problems.append(f"message lacks {missing}")
    return [f"{name}: {'; '.join(problems)}\n  stderr: {err[-800:]}"] if problems else []


def _rows(d: Path, rows: list[tuple[str, list[str], signal.Signals | None, int, int, tuple[str, ...]]]) -> None:
    """Each (name, argv, signal, picks before the sleep, exit status, needles), two at a time."""
    def one(row: tuple[str, list[str], signal.Signals | None, int, int, tuple[str, ...]]) -> list[str]:
        name, argv, sig, after, want, needles = row
        return _check(name, *_stopped(argv, d, name, sig, after), want, needles)

    with ThreadPoolExecutor(2) as pool:
        failures = [f for got in pool.map(one, rows) for f in got]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_generate_is_stopped_by_sigterm_and_sigint_while_a_plugin_sleeps(d: Path, trained_qn4: Path) -> None:
    argv = ["generate", str(trained_qn4), "-p", "def fib(n):", "-n", "32", "--set", "pool.expert_slots=8",
            "--set", f"pool.evict_policy={MODULE}:Sleep"]
    named = (f"'{MODULE}:Sleep'", "Sleep.pick", "2 s")
    _rows(d, [("generate-TERM", argv, signal.SIGTERM, 100, 128 + signal.SIGTERM, ("SIGTERM", *named)),
              ("generate-INT", argv, signal.SIGINT, 100, 128 + signal.SIGINT, ("SIGINT", *named))])


@pytest.mark.slow
def test_replay_is_stopped_by_signals_and_by_the_watchdog_while_a_plugin_blocks(d: Path) -> None:
    log = str(d / "r.qtrace")
    argv = ["replay", log, "--set", REC, "--set", "pool.expert_slots=4", "--set", f"pool.evict_policy={MODULE}:Sleep"]
    spin = ["replay", log, "--set", REC, "--set", "pool.expert_slots=4", "--set", f"pool.evict_policy={MODULE}:Spin",
            "--set", "diag.watchdog_s=1"]
    named = (f"'{MODULE}:Sleep'", "Sleep.pick")
    _rows(d, [("replay-TERM", argv, signal.SIGTERM, 5, 128 + signal.SIGTERM, ("SIGTERM", *named)),
              ("replay-INT", argv, signal.SIGINT, 5, 128 + signal.SIGINT, ("interrupted", *named)),
              ("replay-watchdog", spin, None, 0, 2,
               ("no progress for", "diag.watchdog_s=1", f"'{MODULE}:Spin'", "Spin.pick"))])


@pytest.mark.slow
def test_a_sweep_point_over_its_time_limit_is_killed_and_named_the_others_complete(d: Path) -> None:
    out = d / "sweep.json"
    argv = [sys.executable, "-m", "qnpipe", "sweep", str(d / "r.qtrace"), "--set", REC, "--set", "pool.expert_slots=4",
            "--grid", f"pool.evict_policy=lru,{MODULE}:Sleep,fifo", "--jobs", "2", "--no-progress",
            "--point-timeout", "2", "-o", str(out)]
    r = subprocess.run(argv, capture_output=True, env=_env(d, d / "sweep.mark", 5), timeout=STOP_S,
                       preexec_fn=_limit)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert "1 of 3 points failed" in err and f"grid point 1 (pool.evict_policy={MODULE}:Sleep)" in err, err
    assert "over its time limit of 2 s (--point-timeout)" in err, err
    import json

    points = json.loads(out.read_text())["points"]
    assert [p["error"] is None for p in points] == [True, False, True]


def test_the_point_timeout_is_checked_before_any_replay(d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.cli import main
    from qnpipe.replay.sweep import POINT_TIMEOUT_S

    argv = ["sweep", str(d / "r.qtrace"), "--set", REC, "--grid", "pool.expert_slots=4,5", "--no-progress"]
    assert main([*argv, "--point-timeout", "-1"]) == 2
    assert "--point-timeout -1: must be >= 0 seconds" in capsys.readouterr().err
    assert main([*argv, "--point-timeout", "5", "--executor", "serial"]) == 2
    assert "--point-timeout is for --executor processes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert f"default {POINT_TIMEOUT_S:g}" in " ".join(capsys.readouterr().out.split())
