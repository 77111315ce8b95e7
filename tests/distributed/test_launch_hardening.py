"""Launch variables (issue 34, item 4) and a stopped rank 0 (item 8).

MLX's ring reads MLX_RANK and MLX_HOSTFILE with no check of its own: a hostfile of `[]` was SIGFPE
(exit 136), `MLX_RANK=-1` SIGSEGV (139), `/dev/zero` grew the process by gigabytes and a FIFO
blocked before the connect deadline was armed. Each is now exit 2 naming the variable, the file
and the value, before MLX sees them: the crash rows through the CLI (two at a time), the rest of
the table on `read_launch` in-process.

A rank 0 stopped with SIGSTOP left the other ranks waiting for ever between steps: they now give
up after `distributed.step_timeout_s`, naming rank 0 and the bound, while an idle rank 0 keeps
them alive (its keep-alive) for longer than that bound.
"""

from __future__ import annotations

import json
import os
import select
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_harness import Case, check_case
from ranks import finish, start

from qnpipe.config.launch import HOSTFILE_CAP, Launch, read_launch
from qnpipe.errors import ConfigError
from qnpipe.live.parallel.deadman import EXIT_CODE

pytestmark = pytest.mark.slow  # rings of processes, each loading the model

DEMO = Path(__file__).resolve().parents[2] / "qnpipe" / "data" / "tiny_trained"
TWO = [["127.0.0.1:5000"], ["127.0.0.1:5001"]]


def _cli_row(name: str, env: dict[str, str], needles: tuple[str, ...]) -> Case:
    return Case(name, ["generate", DEMO, "-p", "hi", "-n", "2", "--distributed"], 2, needles, env=tuple(env.items()))


def test_launch_variables_that_crashed_mlx_are_refused_by_the_cli(tmp_path: Path) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    two = tmp_path / "two.json"
    two.write_text(json.dumps(TWO))
    fifo = tmp_path / "hosts.fifo"
    os.mkfifo(fifo)
    cases = [
        # today: SIGFPE (exit 136): MLX takes the rank modulo 0 ranks
        _cli_row("empty hostfile", {"MLX_RANK": "0", "MLX_HOSTFILE": str(empty)}, ("MLX_HOSTFILE", str(empty), "0 ranks")),
        # today: SIGSEGV (exit 139)
        _cli_row("rank -1", {"MLX_RANK": "-1", "MLX_HOSTFILE": str(two)}, ("MLX_RANK='-1'", "not a rank")),
        # today: read until memory runs out
        _cli_row("hostfile /dev/zero", {"MLX_RANK": "0", "MLX_HOSTFILE": "/dev/zero"},
                 ("MLX_HOSTFILE", "/dev/zero", "device")),
        # today: blocks for ever opening it, before the connect deadline is armed
        _cli_row("hostfile FIFO", {"MLX_RANK": "0", "MLX_HOSTFILE": str(fifo)}, ("MLX_HOSTFILE", str(fifo), "FIFO")),
    ]
    with ThreadPoolExecutor(2) as pool:  # two at a time: each is a Python start-up
        failures = [f for f in pool.map(check_case, cases) if f]
    assert not failures, "\n".join(failures)


def _hostfile(tmp: Path, content: object) -> str:
    path = tmp / "hosts.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


BAD = [
    # (name, MLX_RANK or None for unset, hostfile content, or a path given as such, needles)
    ("rank unset", None, TWO, ("MLX_RANK is not set", "mlx.launch")),
    ("rank empty", "", TWO, ("MLX_RANK=''", "not a rank")),
    ("rank signed", "+1", TWO, ("MLX_RANK='+1'",)),
    ("rank blank", " 1", TWO, ("MLX_RANK=' 1'",)),
    ("rank text", "one", TWO, ("MLX_RANK='one'",)),
    ("rank huge", "99999999999999999999", TWO, ("MLX_RANK='99999999999999999999'",)),
    ("rank beyond the hostfile", "2", TWO, ("MLX_RANK='2'", "2 ranks (0 to 1)")),
    ("hostfile unset", "0", None, ("MLX_HOSTFILE is not set",)),
    ("hostfile missing", "0", Path("/nonexistent/hosts.json"), ("/nonexistent/hosts.json", "not found")),
    ("hostfile a directory", "0", Path("/"), ("MLX_HOSTFILE", "directory")),
    ("hostfile too large", "0", b" " * (HOSTFILE_CAP + 1) + b"[]", ("too large",)),
    ("hostfile not JSON", "0", b"[[", ("not valid JSON",)),
    ("hostfile not UTF-8", "0", b"\xff[]", ("not UTF-8",)),
    ("hostfile deep", "0", b"[" * 100_000, ("not valid JSON",)),
    ("hostfile an object", "0", {"hosts": TWO}, ("a JSON dict, not a list",)),
    ("hostfile one rank", "0", [["127.0.0.1:5000"]], ("1 rank (a ring has at least 2)",)),
    ("hostfile mlx.launch's own format", "0", [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}],
     ("rank 0's entry", "not a list")),
    ("rank without addresses", "0", [["127.0.0.1:5000"], []], ("rank 1's entry is []",)),
    ("ranks of other widths", "0", [["127.0.0.1:5000"], ["127.0.0.1:5001", "127.0.0.1:5002"]],
     ("rank 1 has 2 addresses and rank 0 1",)),
    ("address a number", "0", [["127.0.0.1:5000"], [5001]], ("rank 1's address 5001 is not a string",)),
    ("address without port", "0", [["127.0.0.1"], ["127.0.0.1:5001"]], ("'127.0.0.1'", "no ':port'")),
    ("port 0", "0", [["127.0.0.1:0"], ["127.0.0.1:5001"]], ("port '0'",)),
    ("port 70000", "0", [["127.0.0.1:5000"], ["127.0.0.1:70000"]], ("port '70000'", "1..65535")),
    ("port text", "0", [["127.0.0.1:http"], ["127.0.0.1:5001"]], ("port 'http'",)),
    ("host IPv6", "0", [["::1:5000"], ["::1:5001"]], ("'::1:5000'", "an IPv6 address")),
    ("host bad IPv4", "0", [["300.1.1.1:5000"], ["127.0.0.1:5001"]], ("host '300.1.1.1' is not an IPv4 address",)),
    ("host with a space", "0", [["my host:5000"], ["127.0.0.1:5001"]], ("host 'my host'",)),
    ("address twice", "1", [["127.0.0.1:5000"], ["127.0.0.1:5000"]], ("rank 0 and rank 1 both listen on 127.0.0.1:5000",)),
]


@pytest.mark.parametrize(("name", "rank", "content", "needles"), BAD, ids=[row[0] for row in BAD])
def test_bad_launch_variables_are_named(tmp_path: Path, name: str, rank: str | None, content: object,
                                        needles: tuple[str, ...]) -> None:
    env = {} if rank is None else {"MLX_RANK": rank}
    if content is not None:
        env["MLX_HOSTFILE"] = str(content) if isinstance(content, Path) else _hostfile(tmp_path, content)
    with pytest.raises(ConfigError) as e:
        read_launch(env)
    for needle in needles:
        assert needle in str(e.value), (name, str(e.value))


def test_good_launch_variables_are_read(tmp_path: Path) -> None:
    hosts = [["10.0.0.1:5000", "10.0.0.1:5001"], ["mac-b.local:5000", "mac-b.local:5001"], ["10.0.0.3:65535", "h:1"]]
    got = read_launch({"MLX_RANK": "2", "MLX_HOSTFILE": _hostfile(tmp_path, hosts)})
    assert got == Launch(2, str(tmp_path / "hosts.json"), tuple(tuple(h) for h in hosts))
    assert got.neighbours() == "rank 0 and rank 1"


def test_a_stopped_rank_0_is_given_up_after_the_step_timeout_and_an_idle_one_is_not(tiny_qn4: Path,
                                                                                    tmp_path: Path) -> None:
    """Rank 0 idles (no request) for longer than the step timeout, generates, then is stopped (SIGSTOP)
    while it generates on: rank 1 stays through the idle time and gives up after the stop."""
    timeout_s = 5.0
    scenario = {"prompt": [1, 2, 3], "tokens": 2, "engines": {"stream": {"expert_slots": 4}}, "loop": True,
                "idle_s": 2.4 * timeout_s}
    procs = start(2, tiny_qn4, tmp_path, scenario, env={"QNPIPE_DISTRIBUTED__STEP_TIMEOUT_S": str(timeout_s)})
    try:
        assert procs[0].stdout is not None
        ready, _, _ = select.select([procs[0].stdout], [], [], 240)  # a hang guard
        first = procs[0].stdout.readline() if ready else ""
        assert first.strip() == "generating", finish(procs, timeout_s=5)
        procs[0].send_signal(signal.SIGSTOP)
        [(rc, err)] = finish([procs[1]], timeout_s=60)  # a hang guard: today it never exits
        assert rc == EXIT_CODE, err[-3000:]
        assert f"rank 1: no answer from rank 0 in {timeout_s} s (distributed.step_timeout_s)" in err, err[-3000:]
    finally:
        procs[0].send_signal(signal.SIGCONT)
        finish(procs, timeout_s=10)
