"""Run the real `qnpipe` command as a new user would, under a memory limit and a timeout.

`run_cli` starts `python -m qnpipe ...` in a subprocess with RLIMIT_AS set (so an input that
makes qnpipe allocate gigabytes fails the test as a MemoryError or a kill, not the machine)
and a wall-clock timeout (so a hang fails the test). `check_row` asserts the contract of a
bad-input row: the exit code, the message naming the file / key / value, no traceback, and
nothing left behind in the directories the row names.

A row marked `in_process` (one that fails before a model loads) runs `qnpipe.cli.main` in this
process instead (`run_in_process`: the same clean environment, output captured, an uncaught
exception reported as a traceback, a timer as hang guard): a tenth of a second instead of
half of one. A row marked `tmp_empty` runs with TMPDIR set to a fresh directory and fails when
anything is left in it (`run_with_tmpdir` gives the same to other tests; `stop_with_tmpdir` sends
a signal once the command is under way).
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

MEM_LIMIT = 3 << 30  # address space: MLX and numpy need ~1 GB of it; a runaway allocation needs more
TIMEOUT = 60.0


class Case(NamedTuple):
    """One row of a table-driven CLI test."""

    name: str
    argv: Sequence[Any]  # str, Path or bytes
    rc: int
    needles: tuple[str, ...] = ()  # each must appear on stderr (stdout too for rc 0)
    clean: tuple[Path, ...] = ()  # directories that must hold no temp or partial file afterwards
    stdin: bytes = b""
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = TIMEOUT
    in_process: bool = False  # run qnpipe.cli.main here (rows that fail before a model loads)
    tmp_empty: bool = False  # TMPDIR a fresh directory that must be empty afterwards


def clean_env() -> dict[str, str]:
    drop = ("QNPIPE_", "MOE_TOPK_OVERRIDE", "MODEL", "EXPERT_DIR", "PREFILL_CHUNK", "EXPERT_SLOTS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _limit(mem: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))


def run_cli(argv: Sequence[Any], *, stdin: bytes = b"", timeout: float = TIMEOUT, mem: int = MEM_LIMIT,
            env: tuple[tuple[str, str], ...] = (), cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    args = [a if isinstance(a, bytes) else str(a) for a in argv]
    return subprocess.run([sys.executable, "-m", "qnpipe", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=clean_env() | dict(env), cwd=cwd,
                          preexec_fn=lambda: _limit(mem))


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


@contextlib.contextmanager
def _hang_guard(timeout: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise subprocess.TimeoutExpired("qnpipe (in process)", timeout)

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_in_process(argv: Sequence[Any], *, stdin: bytes = b"", timeout: float = TIMEOUT,
                   env: tuple[tuple[str, str], ...] = (), cwd: Path | None = None,
                   mem: int = MEM_LIMIT) -> subprocess.CompletedProcess[bytes]:
    """`qnpipe ARGV` through qnpipe.cli.main in this process, as run_cli runs it in a subprocess.

    The environment is run_cli's (os.environ swapped for the run, TMPDIR included: the temp module
    re-reads it), the working directory `cwd`; an exception main lets through is printed as the
    interpreter would (a traceback, exit 1). `mem` is not enforced here: for rows that fail early.
    """
    from qnpipe.cli import main

    args = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    saved = (sys.stdin, signal.getsignal(signal.SIGINT), tempfile.tempdir, os.getcwd())
    env_now = clean_env() | dict(env)
    try:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
        tempfile.tempdir = None  # gettempdir() caches the first answer; TMPDIR may differ per row
        if cwd is not None:
            os.chdir(cwd)
        with _environ(env_now), _hang_guard(timeout), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse's usage errors and --help
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except subprocess.TimeoutExpired:
                raise
            except BaseException:
                traceback.print_exc(file=err)
                rc = 1
    finally:
        sys.stdin, sigint, tempfile.tempdir, where = saved
        signal.signal(signal.SIGINT, sigint)
        os.chdir(where)
    return subprocess.CompletedProcess(args, rc, out.getvalue().encode(), err.getvalue().encode())


# MLX keeps the CPU kernels it compiles in $TMPDIR/mlx/<version>/cpu: one cache shared by every run
# (a fresh one costs seconds of compiling per run), not a run's litter. A fresh TMPDIR links it to
# the usual one and does not count it.
MLX_CACHE = "mlx"


def run_with_tmpdir(argv: Sequence[Any], *, in_process: bool = False, env: tuple[tuple[str, str], ...] = (),
                    **kw: Any) -> tuple[subprocess.CompletedProcess[bytes], list[str]]:
    """Run `qnpipe ARGV` (run_cli, or run_in_process) with TMPDIR a fresh directory; the result and the
    names (relative) of what was left in that directory but MLX's kernel cache. The directory is removed."""
    tmp = Path(tempfile.mkdtemp(prefix="qnpipe-test-tmpdir-"))
    try:
        shared = Path(tempfile.gettempdir()) / MLX_CACHE
        shared.mkdir(exist_ok=True)
        (tmp / MLX_CACHE).symlink_to(shared, target_is_directory=True)
        run = run_in_process if in_process else run_cli
        r = run(argv, env=(*env, ("TMPDIR", str(tmp))), **kw)
        return r, sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p != tmp / MLX_CACHE)
    finally:
        with contextlib.suppress(OSError):
            (tmp / MLX_CACHE).unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def _drain(stream: Any, into: bytearray) -> threading.Thread:
    def read() -> None:
        with stream:
            for chunk in iter(lambda: stream.read1(65536), b""):
                into.extend(chunk)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def stop_with_tmpdir(argv: Sequence[Any], ready: Callable[[Path, bytes], bool], *, sig: int = signal.SIGTERM,
                     timeout: float = TIMEOUT, mem: int = MEM_LIMIT, env: tuple[tuple[str, str], ...] = (),
                     cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[bytes], list[str]]:
    """Start `qnpipe ARGV` with TMPDIR a fresh directory, send `sig` once `ready(tmpdir, stdout so far)`
    holds (not at all when it exits first), wait for it; the result and what was left in the directory
    but MLX's kernel cache (as run_with_tmpdir).

    TimeoutExpired (the process killed) when it is neither ready nor gone, or not gone after the
    signal, within `timeout` seconds each: hang guards, no timing is asserted.
    """
    tmp = Path(tempfile.mkdtemp(prefix="qnpipe-test-tmpdir-"))
    args = [a if isinstance(a, bytes) else str(a) for a in argv]
    out, err = bytearray(), bytearray()
    try:
        shared = Path(tempfile.gettempdir()) / MLX_CACHE
        shared.mkdir(exist_ok=True)
        (tmp / MLX_CACHE).symlink_to(shared, target_is_directory=True)
        proc = subprocess.Popen([sys.executable, "-m", "qnpipe", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env=clean_env() | dict(env) | {"TMPDIR": str(tmp)}, preexec_fn=lambda: _limit(mem))
        readers = [_drain(proc.stdout, out), _drain(proc.stderr, err)]
        try:
            waited = 0.0
            while proc.poll() is None and not ready(tmp, bytes(out)):
                if waited > timeout:
                    raise subprocess.TimeoutExpired(args, timeout, bytes(out), bytes(err))
                time.sleep(0.02)
                waited += 0.02
            if proc.poll() is None:
                proc.send_signal(sig)
            rc = proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for t in readers:
            t.join(timeout)
        left = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p != tmp / MLX_CACHE)
        return subprocess.CompletedProcess(args, rc, bytes(out), bytes(err)), left
    finally:
        with contextlib.suppress(OSError):
            (tmp / MLX_CACHE).unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def leftovers(d: Path) -> list[Path]:
    """Temp and partial files qnpipe could leave behind under `d`."""
    if not d.exists():
        return []
    return sorted(p for p in d.rglob("*") if p.name.endswith((".tmp", ".partial")) or ".qnpipe-tmp" in p.name)


def check_case(case: Case, **kw: Any) -> str | None:
    """None when `case` holds, else what went wrong (so a table reports every failing row at once)."""
    left_in_tmp: list[str] = []
    try:
        if case.tmp_empty:
            r, left_in_tmp = run_with_tmpdir(case.argv, in_process=case.in_process, stdin=case.stdin,
                                             timeout=case.timeout, env=case.env, **kw)
        else:
            run = run_in_process if case.in_process else run_cli
            r = run(case.argv, stdin=case.stdin, timeout=case.timeout, env=case.env, **kw)
    except subprocess.TimeoutExpired:
        return f"{case.name}: no answer in {case.timeout}s"
    err = r.stderr.decode(errors="replace")
    text = err + (r.stdout.decode(errors="replace") if case.rc == 0 else "")
    problems = []
    if r.returncode != case.rc:
        problems.append(f"exit {r.returncode}, expected {case.rc}")
    if "Traceback" in err:
        problems.append("traceback")
    if "MemoryError" in err:
        problems.append("MemoryError")
    missing = [n for n in case.needles if n not in text]
    if missing:
        problems.append(f"message lacks {missing}")
    left = [p for d in case.clean for p in leftovers(d)]
    if left:
        problems.append(f"left behind {left}")
    if left_in_tmp:
        problems.append(f"left in TMPDIR {left_in_tmp}")
    if problems:
        return f"{case.name}: {'; '.join(problems)}\n  stderr: {err[-600:]}"
    return None


def check_table(cases: Sequence[Case], **kw: Any) -> None:
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "duplicate row names"
    failures = [f for f in (check_case(c, **kw) for c in cases) if f]
    assert not failures, "\n".join(failures)
