"""`serve`: the engine and the HTTP server in one trio run (one process, one engine, one MLX thread)."""

from __future__ import annotations

import ipaddress
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from qnpipe.config import Config
from qnpipe.errors import QnpipeError
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
    graceful_s: float = 5.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_options(opts: ServerOptions) -> None:
    """Raise QnpipeError for a bind the server refuses: a non-loopback address without an API key."""
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
    hc.accesslog = None
    hc.errorlog = "-"
    hc.h11_max_incomplete_size = 64 * 1024  # request line + headers
    return hc


async def serve_engine(eng: Any, model_dir: str | Path, opts: ServerOptions, *,
                       shutdown: Callable[[], Any] | None = None,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the open AsyncEngine `eng` until `shutdown()` returns (an awaitable) or SIGINT/SIGTERM.

    `task_status.started` gets the bound addresses (`http://127.0.0.1:PORT`; port 0 picks a free one).
    """
    from hypercorn.trio import serve

    check_options(opts)
    served = Served(engine=eng, sched=Scheduler(opts.max_queue), metrics=Metrics(),
                    model_id=opts.model_name or Path(model_dir).name)
    app = build_app(served, opts.limits, opts.api_key)

    async def stop() -> None:
        if shutdown is not None:
            await shutdown()
            return
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                return

    await serve(app, _hypercorn_config(opts), shutdown_trigger=stop, task_status=task_status)  # type: ignore[arg-type]


def run_server(model_dir: str | Path, cfg: Config, opts: ServerOptions,
               on_ready: Callable[[list[str]], None] | None = None) -> None:
    """Open the engine on `model_dir` and serve it until SIGINT or SIGTERM (blocking)."""
    check_options(opts)

    async def main() -> None:
        from qnpipe.embed import open_engine

        async with open_engine(model_dir, cfg) as eng, trio.open_nursery() as nursery:
            binds = await nursery.start(serve_engine, eng, model_dir, opts)
            if on_ready is not None:
                on_ready(binds)

    trio.run(main)
