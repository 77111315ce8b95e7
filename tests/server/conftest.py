"""A qnpipe server on a free loopback port, run in a thread of the test process, and its clients."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.server.run import ServerOptions, serve_engine

MODEL = DEMO_MODEL_DIR  # the shipped tiny trained model: it has a chat template with tools


class ServerThread:
    """`with ServerThread(opts) as srv:` — the engine and the server in one trio run on a thread; `srv.url`."""

    def __init__(self, opts: ServerOptions | None = None, model_dir: Path = MODEL,
                 wrap: Callable[[Any], Any] | None = None, **overrides: Any) -> None:
        self.opts = opts or ServerOptions(port=0)
        self.model_dir = model_dir
        self.wrap = wrap
        self.overrides = overrides
        self._ready: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.engine: Any = None
        self._done = threading.Event()
        self._clients: list[Any] = []  # closed at exit: an open keep-alive socket found by a late GC is an error
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qnpipe-test-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            from qnpipe.engine import open_engine

            self._token = trio.lowlevel.current_trio_token()
            self._stop = stop = trio.Event()
            async with open_engine(self.model_dir, **self.overrides) as eng, trio.open_nursery() as nursery:
                self.engine = self.wrap(eng) if self.wrap is not None else eng
                binds = await nursery.start(lambda task_status: serve_engine(
                    self.engine, self.model_dir, self.opts, shutdown=stop.wait, task_status=task_status))
                self._ready.set_result(binds)

        try:
            trio.run(main)
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            else:
                self.error = e
        finally:
            self._done.set()
        # Park, never end: MLX objects freed on this thread gave it thread-local state whose destructors,
        # run when a thread ends, abort the process if the interpreter is finalizing (see qnpipe.live.mlx_thread).
        threading.Event().wait()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.url = self._ready.result(timeout=120)[0]
        return self

    def stop(self) -> None:
        """Begin the server's shutdown (as SIGINT would), without waiting for it."""
        assert self._token is not None and self._stop is not None
        with contextlib.suppress(trio.RunFinishedError):  # it had stopped already
            self._token.run_sync_soon(self._stop.set)

    def __exit__(self, *exc: object) -> None:
        for c in self._clients:
            c.close()
        self.stop()
        assert self._done.wait(timeout=60), "the server did not stop"
        if self.error is not None:
            raise self.error

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        assert self._token is not None
        return self._token

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (a coroutine function) run in the server's trio loop; its result."""
        assert self._token is not None
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def client(self, **kw: Any) -> Any:
        import openai

        c = openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"),
                          max_retries=kw.pop("max_retries", 0), timeout=kw.pop("timeout", 60), **kw)
        self._clients.append(c)
        return c


def post(url: str, body: bytes, key: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST `body` (JSON) to `url`: the status and the decoded reply."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(srv: ServerThread, key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {'name{labels}': value}."""
    req = urllib.request.Request(f"{srv.url}/metrics", headers={"authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread() as srv:
        yield srv
