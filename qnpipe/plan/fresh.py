"""A fresh interpreter of this package, tied to its parent: what the planner's child processes share
(qnpipe.plan.child plans in one, qnpipe.plan.measured measures the device in one)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds the qnpipe package: first on its path
STDERR_TAIL = 2000  # characters of a failed child's stderr said in the parent's error


def die_with(parent: int) -> None:
    """End when `parent` ends, even killed (Linux: PR_SET_PDEATHSIG): a child nobody waits for any more
    would go on using the memory and the cores the run was given."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # ended before the signal was asked for
        raise SystemExit(1)


__all__ = ["ROOT", "STDERR_TAIL", "die_with"]
