"""Run the real `qnpipe` command as a new user would, under a memory limit and a timeout.

`run_cli` starts `python -m qnpipe ...` in a subprocess with RLIMIT_AS set (so an input that
makes qnpipe allocate gigabytes fails the test as a MemoryError or a kill, not the machine)
and a wall-clock timeout (so a hang fails the test). `check_row` asserts the contract of a
bad-input row: the exit code, the message naming the file / key / value, no traceback, and
nothing left behind in the directories the row names.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Sequence
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


def leftovers(d: Path) -> list[Path]:
    """Temp and partial files qnpipe could leave behind under `d`."""
    if not d.exists():
        return []
    return sorted(p for p in d.rglob("*") if p.name.endswith((".tmp", ".partial")) or ".qnpipe-tmp" in p.name)


def check_case(case: Case, **kw: Any) -> str | None:
    """None when `case` holds, else what went wrong (so a table reports every failing row at once)."""
    try:
        r = run_cli(case.argv, stdin=case.stdin, timeout=case.timeout, env=case.env, **kw)
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
    if problems:
        return f"{case.name}: {'; '.join(problems)}\n  stderr: {err[-600:]}"
    return None


def check_table(cases: Sequence[Case], **kw: Any) -> None:
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "duplicate row names"
    failures = [f for f in (check_case(c, **kw) for c in cases) if f]
    assert not failures, "\n".join(failures)
