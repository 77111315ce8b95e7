"""One line per request on stderr: client, method, path, status, tokens (prompt+completion), seconds.

`AccessLog` wraps the whole app (the key check too, so a 401 is logged); a generation answer
(qnpipe.server.generation) puts its token counts in the entry this middleware leaves in the
scope (`ENTRY`). Lines go to the `qnpipe.server.access` logger at INFO: `--log-level warning`
silences them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads LEVELS without importing the web stack
    from starlette.types import ASGIApp, Receive, Scope, Send

ENTRY = "qnpipe.access"  # the scope key of the request's entry: {"tokens": (prompt, completion)}
LEVELS = ("debug", "info", "warning", "error", "critical")

log = logging.getLogger("qnpipe.server.access")


def configure(level: str) -> None:
    """Access lines (INFO) and the server's errors to stderr at `level`, hypercorn's error log included."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("qnpipe serve: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())


def line(client: Any, method: str, path: str, status: int | None, tokens: tuple[int, int] | None,
         seconds: float) -> str:
    who = f"{client[0]}:{client[1]}" if client else "-"
    used = f"{tokens[0]}+{tokens[1]} tokens" if tokens is not None else "- tokens"
    return f'{who} "{method} {path}" {status if status is not None else "-"} {used} {seconds:.3f}s'


class AccessLog:
    """ASGI middleware writing `line` once each HTTP request has been answered (or its client left)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry: dict[str, Any] = {}
        scope[ENTRY] = entry
        status: int | None = None
        t0 = time.perf_counter()

        async def tracked(msg: MutableMapping[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(line(scope.get("client"), scope["method"], scope["path"],
                              status if status is not None else 499, entry.get("tokens"), time.perf_counter() - t0))
