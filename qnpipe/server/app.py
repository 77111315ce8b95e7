"""The Starlette app: routes, the bearer-key check, the body's cap and deadline, JSON errors in OpenAI's shape."""

from __future__ import annotations

import hmac
import re
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from qnpipe.server import schemas as s
from qnpipe.server.access_log import AccessLog
from qnpipe.server.generation import GenerationResponse, Served, error_body, send_json
from qnpipe.server.jobs import BadRequest, Limits, chat_job, completion_job
from qnpipe.server.metrics import render

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
# Nesting a request's free-form JSON (tool schemas) may have: real schemas use a handful of
# levels; far deeper ones only exhaust the decoder's and the template's recursion.
MAX_JSON_DEPTH = 64
# Reachable without the key: a liveness probe learns nothing but that the server is up.
OPEN_PATHS = frozenset({"/health"})


class BearerAuth:
    """ASGI middleware: every path but OPEN_PATHS needs `Authorization: Bearer <key>` (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str, served: Served) -> None:
        self.app = app
        self.key = api_key.encode()
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
            self.served.metrics.request(endpoint_label(scope["path"]), 401)
            await send_json(send, 401, error_body(401, "missing or wrong API key (send Authorization: Bearer KEY)"),
                            [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """The request body is over the server's cap (413)."""


class BodyTooSlow(Exception):
    """The request body did not arrive within the server's deadline (408)."""


class _RawTools(msgspec.Struct):
    """A chat body's tools with their keys in the order the client wrote them (the template renders that order)."""

    tools: list[dict[str, Any]] | None = None


def endpoint_label(path: str) -> str:
    """The metrics label of a path: the endpoint, or "other" (a client must not grow the label set)."""
    return path if path in ENDPOINTS else "other"


def _json(status: int, obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param), status_code=status, media_type="application/json",
                    headers=headers)


async def _body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most `limit` bytes, all of it within `timeout_s` (a client trickling it is cut off).

    The deadline covers the body as a whole, not each read: hypercorn's `read_timeout` is per
    read and also runs while a long answer is written, when a client sends nothing.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"the request body is {length} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    with trio.move_on_after(timeout_s) as deadline:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the request body is over {limit} bytes, this server's cap")
            chunks.append(chunk)
    if deadline.cancelled_caught:
        raise BodyTooSlow(f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)")
    return b"".join(chunks)


def _too_deep(obj: Any, limit: int) -> bool:
    """Whether `obj` (decoded JSON) nests lists and objects more than `limit` levels deep (no recursion)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict | list):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


def build_app(served: Served, limits: Limits, api_key: str | None = None) -> ASGIApp:
    """The ASGI app serving `served.engine`; `api_key` None = no key (loopback only: checked by the caller)."""
    eng = served.engine

    async def generation(request: Request, endpoint: str, kind: type[s.ChatRequest] | type[s.CompletionRequest]
                         ) -> Any:
        try:
            raw = await _body(request, limits.max_body_bytes, limits.body_timeout_s)
            try:
                req = msgspec.json.decode(raw, type=kind)
                tools = msgspec.json.decode(raw, type=_RawTools).tools if isinstance(req, s.ChatRequest) else None
            except RecursionError:
                raise BadRequest(f"the body nests JSON too deeply (at most {MAX_JSON_DEPTH} levels are taken)"
                                 ) from None
            for i, t in enumerate(tools or ()):
                if _too_deep(t, MAX_JSON_DEPTH):
                    raise BadRequest(f"tools[{i}]: nested more than {MAX_JSON_DEPTH} levels deep", f"tools[{i}]")
            job = (chat_job(req, eng, limits, tools) if isinstance(req, s.ChatRequest)
                   else completion_job(req, eng.args.vocab_size, limits))
        except ClientDisconnect:
            served.metrics.request(endpoint, 499)
            return Response(status_code=499)
        except BodyTooLarge as e:
            served.metrics.request(endpoint, 413)
            return _error(413, str(e))
        except BodyTooSlow as e:
            served.metrics.request(endpoint, 408)
            return _error(408, str(e), headers={"connection": "close"})
        except BadRequest as e:
            served.metrics.request(endpoint, 400)
            return _error(400, str(e), e.param)
        except msgspec.ValidationError as e:
            served.metrics.request(endpoint, 400)
            return _error(400, f"invalid request: {e}", _param(str(e)))
        except msgspec.DecodeError as e:
            served.metrics.request(endpoint, 400)
            return _error(400, f"the body is not valid JSON: {e}")
        return GenerationResponse(served, job, endpoint)

    async def chat(request: Request) -> Any:
        return await generation(request, "/v1/chat/completions", s.ChatRequest)

    async def completions(request: Request) -> Any:
        return await generation(request, "/v1/completions", s.CompletionRequest)

    async def models(request: Request) -> Response:
        served.metrics.request("/v1/models", 200)
        return _json(200, s.ModelList(data=[s.ModelCard(id=served.model_id, created=0)]))

    async def health(request: Request) -> Response:
        served.metrics.request("/health", 200)
        sched = served.sched
        return _json(200, {"status": "ok", "model": served.model_id, "queue_depth": sched.waiting,
                           "running": sched.running})

    async def metrics(request: Request) -> Response:
        served.metrics.request("/metrics", 200)
        return Response(render(served.metrics, served.sched, eng.stats()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        served.metrics.request(endpoint_label(request.url.path), status)
        detail = exc.detail if isinstance(exc, HTTPException) else f"internal error ({type(exc).__name__})"
        return _error(status, f"{request.method} {request.url.path}: {detail}")

    app: ASGIApp = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: http_error})
    if api_key is not None:
        app = BearerAuth(app, api_key, served)
    return AccessLog(app)


def _param(message: str) -> str | None:
    """The field path of a msgspec ValidationError (`... - at `$.messages[0].role``) without the `$.`."""
    head, sep, where = message.rpartition(" - at `")
    path = where.rstrip("`") if sep else "$"
    path = path[2:] if path.startswith("$.") else "" if path == "$" else path
    field = re.search(r"(?:unknown|missing required) field `([^`]*)`", head if sep else message)
    if field:  # the unknown or missing key itself, under the object that holds it
        path = f"{path}.{field.group(1)}" if path else field.group(1)
    return path or None
