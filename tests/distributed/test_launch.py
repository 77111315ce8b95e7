"""The CLI on a ring: `mlx.launch --backend ring -n 2 -- qnpipe generate ... --distributed` prints
once what one process prints, `qnpipe serve --distributed` listens on rank 0 only and answers as one
process does, and a terminal's Ctrl-C (sent to every rank at once) stops the ring cleanly. Every wait
is bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qnpipe.live.parallel.localhost import write_local_hostfile

pytestmark = pytest.mark.slow  # rings of processes, each loading the model

QNPIPE = [sys.executable, "-m", "qnpipe"]
GENERATE = ["generate", "-p", "def read_lines(path):", "-n", "8"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("QNPIPE_", "MLX_"))}


def _free_port_pair() -> int:
    """A port p with p + 1 free too, for mlx.launch's ring (one port per rank on localhost)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    raise AssertionError("no two adjacent free ports")


def test_mlx_launch_runs_the_cli_on_two_ranks_and_only_rank_0_writes(tiny_qn4: Path, tmp_path: Path) -> None:
    one = subprocess.run([*QNPIPE, GENERATE[0], str(tiny_qn4), *GENERATE[1:]], capture_output=True, text=True,
                         env=_env(), timeout=120, check=False)
    assert one.returncode == 0, one.stderr
    launch = Path(sys.executable).with_name("mlx.launch")
    ring = subprocess.run([str(launch), "--backend", "ring", "-n", "2", "--starting-port", str(_free_port_pair()),
                           "--", *QNPIPE, GENERATE[0], str(tiny_qn4), *GENERATE[1:], "--distributed"],
                          capture_output=True, text=True, env=_env(), timeout=180, check=False, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert ring.returncode == 0, ring.stderr[-3000:]
    assert one.stdout.strip() and ring.stdout == one.stdout  # rank 1 wrote nothing


def test_ctrl_c_on_every_rank_stops_the_ring_cleanly(tiny_qn4: Path, tmp_path: Path) -> None:
    hostfile = write_local_hostfile(tmp_path / "hosts.json", 2)
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as files:
        for r in range(2):
            env = {**_env(), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
            out, err = (files.enter_context((tmp_path / f"{name}{r}").open("wb")) for name in ("out", "err"))
            procs.append(subprocess.Popen(
                [*QNPIPE, "generate", str(tiny_qn4), "-p", "hello", "-n", "5000", "--distributed"], env=env,
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, process_group=0 if r == 0 else procs[0].pid))
        _ctrl_c_when_generating(procs, tmp_path)


def _ctrl_c_when_generating(procs: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    try:
        deadline = time.monotonic() + 120
        while (tmp_path / "out0").stat().st_size == 0:  # rank 0 is generating
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [(tmp_path / f"err{r}").read_text() for r in range(2)]
            time.sleep(0.1)
        os.killpg(procs[0].pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        codes = [p.wait(timeout=10) for p in procs]
        err = [(tmp_path / f"err{r}").read_text() for r in range(2)]
        assert codes == [130, 0], err
        assert "qnpipe generate: interrupted" in err[0]
        assert "rank 1: Ctrl-C: waiting for rank 0 to stop the ring" in err[1] and "Traceback" not in err[1], err[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_serve_on_a_ring_listens_on_rank_0_only_and_answers_as_one_process(tiny_qn4: Path, tmp_path: Path) -> None:
    import json
    import re
    import urllib.request

    from qnpipe import Engine

    prompt = "def read_lines(path):"
    with Engine(tiny_qn4) as eng:
        want = eng.generate(prompt, max_tokens=6, stop_at_eos=False).text
    hostfile = write_local_hostfile(tmp_path / "hosts.json", 2)
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as files:
        for r in range(2):
            env = {**_env(), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
            err = files.enter_context((tmp_path / f"err{r}").open("wb"))
            procs.append(subprocess.Popen([*QNPIPE, "serve", str(tiny_qn4), "--port", "0", "--distributed"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                          process_group=0 if r == 0 else procs[0].pid))
        try:
            deadline = time.monotonic() + 120
            while (m := re.search(r"qnpipe serve: \S+ on (http://127\.0\.0\.1:\d+)",
                                  (tmp_path / "err0").read_text())) is None:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    [(tmp_path / f"err{r}").read_text() for r in range(2)]
                time.sleep(0.1)
            req = urllib.request.Request(f"{m.group(1)}/v1/completions", method="POST", headers={
                "content-type": "application/json"}, data=json.dumps({"prompt": prompt, "max_tokens": 6,
                                                                      "temperature": 0}).encode())
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.loads(resp.read())["choices"][0]["text"] == want
            os.killpg(procs[0].pid, signal.SIGINT)
            assert [p.wait(timeout=20) for p in procs] == [0, 0], [(tmp_path / f"err{r}").read_text() for r in range(2)]
            assert "qnpipe serve:" not in (tmp_path / "err1").read_text()  # rank 1 never listened
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
