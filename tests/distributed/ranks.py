"""Starting a test ring on localhost: each rank a `rank_main.py` process (MLX_RANK, MLX_HOSTFILE on free
ports, as mlx.launch would), every wait bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qnpipe.live.parallel.localhost import write_local_hostfile

RANK_MAIN = Path(__file__).with_name("rank_main.py")


def start(ranks: int, model_dir: Path, tmp: Path, scenario: dict, *, only: list[int] | None = None,
          env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    hostfile = write_local_hostfile(tmp / "hosts.json", ranks)
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    procs = []
    for r in only if only is not None else range(ranks):
        e = {k: v for k, v in os.environ.items() if not k.startswith(("QNPIPE_", "MLX_"))}
        e.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(RANK_MAIN), str(model_dir), str(tmp / f"out{r}.npz"),
                                       str(tmp / "scenario.json")], env=e, cwd=tmp, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process, killing those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out
