"""Issue 34 item 8: every wait on another host is bounded, said before it starts, and named when it ends.

`convert OWNER/NAME` against a Hub endpoint (or a proxy) that accepts and never answers, answers
HTTP 500, answers bytes that are not HTTP, or answers HTTP 200 with a body that is not the Hub's
JSON; `sweep --executor dask` against a port nothing listens on and one that accepts and never
answers. Every host here is this test's own socket on 127.0.0.1: nothing leaves the machine. The
bounds are set small (`net.*` through --set) and the harness timeout catches a wait past them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_harness import Case, check_table

from qnpipe.replay.synth import SynthSpec, write_synth

REPO = "qnpipe-test/no-such-model"
BOUND_S = 2  # the configured bound of every row: small, so a row takes seconds
HANG_GUARD_S = 30.0  # the harness timeout: a wait past the bound shows as "no answer"

_BAD_JSON = b"{not json"
_ANSWERS: dict[str, bytes | None] = {
    "stall": None,  # accepts, reads, never answers
    "http500": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\nConnection: close\r\n\r\noops!",
    "not-http": b"\x00\xffthis is not http\r\n\r\n",
    "not-json": (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
                 b"\r\n\r\n%s" % (len(_BAD_JSON), _BAD_JSON)),
}


class _Host:
    """A TCP server on 127.0.0.1 that gives every connection the same answer (or none), until stopped."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.held.append(conn)  # closed at stop(): a stalled client must see no EOF before its bound
            if self.answer is not None:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            conn.recv(65536)
            conn.sendall(self.answer or b"")
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture(scope="module")
def hosts() -> Iterator[Callable[[str], int]]:
    """hosts(kind) -> a loopback port: one of _ANSWERS' servers, or "refused" (bound, not listening)."""
    made: dict[str, _Host] = {}
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # held, never listening: a connect is refused, and no one else takes the port

    def port(kind: str) -> int:
        if kind == "refused":
            return closed.getsockname()[1]
        if kind not in made:
            made[kind] = _Host(_ANSWERS[kind])
        return made[kind].port

    yield port
    closed.close()
    for h in made.values():
        h.stop()


def _hub_env(tmp: Path, endpoint: str, proxy: str = "") -> tuple[tuple[str, str], ...]:
    env = [("HF_ENDPOINT", endpoint), ("HF_HUB_CACHE", str(tmp / "hub")), ("HF_HOME", str(tmp / "hf-home")),
           ("HF_HUB_OFFLINE", "0"), ("NO_PROXY", "" if proxy else "*"), ("no_proxy", "" if proxy else "*")]
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env.append((name, proxy))
    return tuple(env)


@pytest.mark.slow
def test_convert_from_a_hub_that_does_not_answer_fails_within_its_bound(tmp_path: Path,
                                                                         hosts: Callable[[str], int]) -> None:
    out = tmp_path / "qn"
    bound = ["--set", f"net.hub_timeout_s={BOUND_S}"]

    def row(name: str, kind: str, *needles: str, via_proxy: bool = False) -> Case:
        url = f"http://127.0.0.1:{hosts(kind)}"
        # Through a proxy the endpoint's name never reaches a resolver: the proxy is asked for it.
        env = _hub_env(tmp_path, "https://hub.invalid", url) if via_proxy else _hub_env(tmp_path, url)
        return Case(name, ["convert", REPO, "--out", out, *bound], 2, (f"SRC {REPO}", *needles),
                    clean=(tmp_path,), env=env, timeout=HANG_GUARD_S)

    wait = f"timeout {BOUND_S} s"
    check_table([
        row("endpoint accepts, never answers", "stall", f"asking http://127.0.0.1:{hosts('stall')}",
            wait, f"no answer from http://127.0.0.1:{hosts('stall')} within {BOUND_S} s",
            "net.hub_timeout_s", "HF_HUB_OFFLINE=1", "local checkpoint directory"),
        row("proxy accepts, never answers", "stall", "asking https://hub.invalid", wait,
            f"no answer from https://hub.invalid within {BOUND_S} s", "proxy", "HF_HUB_OFFLINE=1", via_proxy=True),
        row("endpoint answers HTTP 500", "http500", f"http://127.0.0.1:{hosts('http500')}", "500",
            "HF_HUB_OFFLINE=1"),
        row("endpoint answers bytes that are not HTTP", "not-http", f"http://127.0.0.1:{hosts('not-http')}",
            "not HTTP", "HF_ENDPOINT"),
        row("endpoint answers a body that is not JSON", "not-json", f"http://127.0.0.1:{hosts('not-json')}",
            "not the Hub's", "HF_ENDPOINT"),
    ])
    assert not out.exists()


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nw") / "r.qtrace"
    write_synth(path, SynthSpec(layers=2, experts=16, top_k=2, tokens=10, seed=1))
    return path


@pytest.mark.slow
def test_a_dask_scheduler_that_does_not_answer_fails_within_its_bound(log: Path, tmp_path: Path,
                                                                      hosts: Callable[[str], int]) -> None:
    out = tmp_path / "sweep.json"

    def argv(address: str) -> list[object]:
        return ["sweep", log, "--set", "replay.record_nbytes=1000000", "--grid", "pool.expert_slots=4,8",
                "--executor", "dask", "--scheduler", address, "--set", f"net.dask_connect_timeout_s={BOUND_S}",
                "-o", out]

    def row(name: str, kind: str, *needles: str) -> Case:
        address = f"tcp://127.0.0.1:{hosts(kind)}"
        return Case(name, argv(address), 2, (
            f"connecting to the Dask scheduler at {address} (timeout {BOUND_S} s", f"the Dask scheduler at {address}",
            f"{BOUND_S} s", "net.dask_connect_timeout_s", *needles), clean=(tmp_path,), timeout=HANG_GUARD_S)

    check_table([
        row("nothing listens", "refused", "cannot connect"),
        row("accepts, never answers", "stall", "no answer"),
        Case("an address distributed cannot parse", argv("tcp://127.0.0.1:port"), 2,
             ("--scheduler 'tcp://127.0.0.1:port'", "tcp://HOST:8786"), timeout=HANG_GUARD_S),
    ])
    assert not out.exists()
