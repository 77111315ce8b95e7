"""`serve`: the engine and the HTTP server in one trio run (one process, one engine, one MLX thread).

The listening sockets are bound before the model loads, so a port in use fails in a second
rather than after minutes of loading. They listen from then on (a second server started
meanwhile cannot take the port either); connections made while the model loads wait in the
backlog and are answered once it is ready.
"""

from __future__ import annotations

import errno
import ipaddress
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from qnpipe import hang_guard
from qnpipe.config import Config
from qnpipe.errors import QnpipeError
from qnpipe.server.access_log import configure
from qnpipe.server.app import build_app
from qnpipe.server.generation import Served
from qnpipe.server.jobs import Limits
from qnpipe.server.metrics import Metrics
from qnpipe.server.scheduling import Scheduler


@attrs.define
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 8
    limits: Limits = attrs.field(factory=Limits)
    model_name: str | None = None  # the id /v1/models shows; default: the model directory's name
    graceful_s: float = 5.0  # on SIGINT/SIGTERM: how long the requests in flight have (see `cut_after`)
    log_level: str = "info"  # access lines at info (qnpipe.server.access_log)


def cut_after(graceful_s: float) -> float:
    """How long the generation in flight may run once the server stops: the grace less the last second
    (at least half of it), which is left for sending the cut answers' ends."""
    return max(graceful_s - 1.0, graceful_s / 2)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_options(opts: ServerOptions) -> None:
    """Raise QnpipeError for options the server refuses: an empty API key, a non-loopback address without one."""
    if opts.api_key is not None and not opts.api_key.strip():
        raise QnpipeError("the API key is empty: give a non-empty --api-key or --api-key-file (or none, "
                          "on loopback only)")
    if not is_loopback(opts.host) and not opts.api_key:
        raise QnpipeError(f"--host {opts.host} is not a loopback address: binding it needs --api-key "
                          f"(or bind 127.0.0.1)")
    if opts.max_queue < 0:
        raise QnpipeError(f"--max-queue must be >= 0, got {opts.max_queue}")


def _hypercorn_config(opts: ServerOptions) -> Any:
    from hypercorn.config import Config as HConfig

    hc = HConfig()
    host = f"[{opts.host}]" if ":" in opts.host and not opts.host.startswith("[") else opts.host
    hc.bind = [f"{host}:{opts.port}"]
    hc.graceful_timeout = opts.graceful_s
    hc.accesslog = None  # qnpipe.server.access_log writes its own lines, with the tokens
    hc.errorlog = "-"
    hc.loglevel = opts.log_level.upper()
    hc.h11_max_incomplete_size = 64 * 1024  # request line + headers
    # A request line and headers must come within keep_alive_timeout (hypercorn's idle timer runs until a
    # request is complete); the body has its own deadline (Limits.body_timeout_s, in the app).
    hc.keep_alive_timeout = 5.0
    return hc


def bind(opts: ServerOptions) -> Any:
    """The server's sockets, bound and listening: QnpipeError naming the address when it is taken."""
    hc = _hypercorn_config(opts)
    try:
        sockets = hc.create_sockets()
    except OSError as e:
        raise _bind_error(opts, e) from None
    try:
        for sock in sockets.insecure_sockets:
            sock.listen(hc.backlog)
    except OSError as e:
        for sock in sockets.insecure_sockets:
            sock.close()
        raise _bind_error(opts, e) from None
    return sockets


def _bind_error(opts: ServerOptions, e: OSError) -> QnpipeError:
    hint = ("; is another server running there? pick another --port (0 picks a free one)"
            if e.errno == errno.EADDRINUSE else "")
    return QnpipeError(f"cannot listen on {opts.host}:{opts.port} ({e.strerror or e}){hint}")


async def serve_engine(eng: Any, model_dir: str | Path, opts: ServerOptions, *,
                       shutdown: Callable[[], Any] | None = None, sockets: Any = None,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the open AsyncEngine `eng` until `shutdown()` returns (an awaitable) or SIGINT/SIGTERM/SIGHUP.

    `sockets` are those `bind` made (None: bound here). `task_status.started` gets the bound
    addresses (`http://127.0.0.1:PORT`; port 0 picks a free one).
    """
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    check_options(opts)
    configure(opts.log_level)
    served = Served(engine=eng, sched=Scheduler(opts.max_queue), metrics=Metrics(),
                    model_id=opts.model_name or Path(model_dir).name, cut_after_s=cut_after(opts.graceful_s))
    app = build_app(served, opts.limits, opts.api_key)
    hc = _hypercorn_config(opts)
    own = sockets is None
    if sockets is None:
        sockets = bind(opts)

    async def stop() -> None:
        try:
            if shutdown is not None:
                await shutdown()
                return
            # SIGHUP too: a server started from a terminal that closes stops cleanly (heat saved).
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                # This loop answers them; a plug-in's call that never returns would keep it from ever doing so.
                hang_guard.chain(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                async for _ in signals:
                    return
        finally:
            served.closing.set()  # waiting requests get 503, the one generating `cut_after_s` more

    try:
        await worker_serve(wrap_app(app, hc.wsgi_max_body_size, "asgi"), hc, sockets=sockets,  # type: ignore[arg-type]
                           shutdown_trigger=stop, task_status=task_status)
    finally:
        if own:
            for sock in sockets.insecure_sockets:
                sock.close()


def run_server(model_dir: str | Path, cfg: Config, opts: ServerOptions,
               on_ready: Callable[[list[str]], None] | None = None) -> int | None:
    """Open the engine on `model_dir` and serve it until SIGINT, SIGTERM or SIGHUP (blocking); the signal.

    The port is bound first: a port in use is a QnpipeError before the model loads. One signal
    receiver covers the whole run, the load included, so a stop is the same whenever it comes:
    the first signal stops the server gracefully (`ServerOptions.graceful_s`; during the load, the
    load), a second one cancels what is left at once (the engine still closes). Nothing is then
    raised in the middle of an MLX call, so no thread reports to a loop that has ended.
    With `distributed.enabled` only rank 0 binds and serves; the other ranks serve its steps
    until it stops (docs/distributed.md).
    """
    check_options(opts)
    follower = False
    if cfg.distributed.enabled:
        from qnpipe.config.launch import read_launch

        follower = read_launch().rank > 0  # bad launch variables are refused before the port is bound
    sockets = None if follower else bind(opts)
    got: list[int] = []

    async def follow() -> None:
        from qnpipe.engine import open_engine

        async with open_engine(model_dir, cfg):  # a later rank: serves rank 0's steps until it stops
            pass

    async def main() -> None:
        from qnpipe.engine import open_engine

        stopping = trio.Event()
        serving = False
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            # This loop answers them; a plug-in's call that never returns would keep it from ever doing so.
            hang_guard.chain(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            async with trio.open_nursery() as outer:
                async def watch() -> None:
                    async for signum in signals:
                        got.append(signum)
                        stopping.set()
                        if len(got) > 1 or not serving:  # a second signal, or still loading: no grace
                            outer.cancel_scope.cancel()

                outer.start_soon(watch)
                try:
                    async with open_engine(model_dir, cfg) as eng, trio.open_nursery() as nursery:
                        assert sockets is not None
                        binds = await nursery.start(partial(serve_engine, eng, model_dir, opts, sockets=sockets,
                                                            shutdown=stopping.wait))
                        serving = True
                        if on_ready is not None and not stopping.is_set():
                            on_ready(binds)
                finally:
                    outer.cancel_scope.cancel()

    try:
        trio.run(follow if follower else main)
    except KeyboardInterrupt:
        if not got:  # before the receiver was in place: Ctrl-C as every command takes it
            raise
        # after it was gone, in the run's last instants: the same stop
    finally:
        for sock in sockets.insecure_sockets if sockets is not None else ():
            sock.close()
    return got[0] if got else None
