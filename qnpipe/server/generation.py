"""The ASGI response that runs a Job on the engine: queued, streamed or not, cancelled when the client leaves.

Admission (429) is decided before anything is sent; the headers go out once the request
has its turn and its prompt is checked, so a queued request that turns out bad still gets
its 400. While the request waits or generates, a task listens for `http.disconnect`: the
client leaving cancels the generation, which stops at its next layer and leaves the engine
usable (every generation starts from a fresh cache, so the next request is exact).

When the server stops (`Served.closing`), a request still waiting gets 503 at once and the one
generating gets `cut_after_s` to finish; past it the generation is cancelled and the answer
ends properly: a 503 error body, or for a stream that already began an SSE error event and
`data: [DONE]`, so a client never mistakes a cut stream for a whole one.
"""

from __future__ import annotations

import math
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import msgspec
import trio

from qnpipe.chat.escape import encode_marked, has_marks
from qnpipe.errors import ChatError, QnpipeError
from qnpipe.server import schemas as s
from qnpipe.server.access_log import ENTRY
from qnpipe.server.jobs import BadRequest, Job
from qnpipe.server.metrics import Metrics
from qnpipe.server.scheduling import QueueFull, Scheduler
from qnpipe.server.textgate import TextGate
from qnpipe.server.tool_calls import MARKER, split_tool_calls
from qnpipe.stats import FinishReason

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

_ENC = msgspec.json.Encoder()


@attrs.define
class Outcome:
    content: str
    tool_calls: list[s.OutToolCall]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def usage(self) -> s.Usage:
        return s.Usage(self.prompt_tokens, self.completion_tokens, self.prompt_tokens + self.completion_tokens)


SHUTTING_DOWN = "the server is shutting down"


@attrs.define
class Served:
    """What every response shares: the engine, the queue, the counters, the model's name."""

    engine: Any  # AsyncEngine
    sched: Scheduler
    metrics: Metrics
    model_id: str
    closing: trio.Event = attrs.field(factory=trio.Event)  # set when the server begins to stop
    cut_after_s: float = 4.0  # how long the generation in flight may still run once closing is set


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "invalid_request_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return _ENC.encode(s.ErrorBody(s.ErrorDetail(message=message, type=kind, param=param)))


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def run_job(eng: Any, job: Job, ids: list[int], on_content: Callable[[str], None]) -> Outcome:
    """Generate for `job`; content pieces go to `on_content` as they are settled (trio thread)."""
    gate = TextGate(job.stops, MARKER if job.tools else None)
    partial: list[int] = []
    res = None
    with trio.CancelScope() as stop_scope:
        def on_text(piece: str) -> None:
            if out := gate.feed(piece):
                on_content(out)
            if gate.stopped:
                stop_scope.cancel()  # a stop string: the generation ends at its next layer

        res = await eng.generate(ids, max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                                 top_k=job.top_k, min_p=job.min_p, seed=job.seed, stop_at_eos=not job.ignore_eos, on_text=on_text, partial=partial)
    if rest := gate.finish():
        on_content(rest)
    content = gate.content
    calls, rest = split_tool_calls(gate.tool_text) if gate.tool_text else ([], "")
    if rest:  # what is not a well-formed call reaches the client as the text it is
        on_content(rest)
        content += rest
    if calls:
        reason = "tool_calls"
    elif gate.stopped or (res is not None and res.stats.finish_reason is FinishReason.EOS):
        reason = "stop"
    else:
        reason = "length"
    n = res.stats.generated_tokens if res is not None else len(partial)
    return Outcome(content, calls, reason, len(ids), n)


class GenerationResponse:
    """An ASGI app answering one chat or completions request."""

    def __init__(self, served: Served, job: Job, endpoint: str) -> None:
        self.served = served
        self.job = job
        self.endpoint = endpoint
        self.rid = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.disconnected = False
        self.finished = False
        self.generating = False
        self.stop = trio.CancelScope()  # cancelled when the server stops (`_watch_closing`)
        self.outcome: Outcome | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        sv = self.served
        if sv.closing.is_set():
            sv.metrics.request(self.endpoint, 503)
            await send_json(send, 503, error_body(503, SHUTTING_DOWN))
            return
        try:
            sv.sched.admit()
        except QueueFull as e:
            sv.metrics.request(self.endpoint, 429)
            await send_json(send, 429, error_body(429, str(e)), [(b"retry-after", str(e.retry_after).encode())])
            return
        started = False

        async def tracked(msg: MutableMapping[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True  # counted before it is sent: a client reading /metrics next sees it
                sv.metrics.request(self.endpoint, msg["status"])
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                self.finished = True  # from here on, the server may report the connection's end
            await send(msg)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, receive, nursery.cancel_scope)
            nursery.start_soon(self._watch_closing)
            try:
                with self.stop:
                    async with sv.sched.turn():
                        self.generating = True
                        await self._answer(tracked)
                if self.stop.cancelled_caught and not self.finished:
                    await self._cut(tracked, started)
            finally:
                nursery.cancel_scope.cancel()
        if not started:
            sv.metrics.request(self.endpoint, 499)  # the client left before an answer started
        if self.outcome is not None and (entry := scope.get(ENTRY)) is not None:
            entry["tokens"] = (self.outcome.prompt_tokens, self.outcome.completion_tokens)

    async def _watch_closing(self) -> None:
        await self.served.closing.wait()
        if self.generating:
            await trio.sleep(self.served.cut_after_s)
        self.stop.cancel()

    async def _cut(self, send: Send, started: bool) -> None:
        """End an answer the server's stop cut short: 503, or (a stream already begun) an error event and [DONE]."""
        if not started:
            await send_json(send, 503, error_body(503, SHUTTING_DOWN))
            return
        event = error_body(503, f"{SHUTTING_DOWN}: the answer was cut off")
        await send({"type": "http.response.body", "body": b"data: " + event + b"\n\ndata: [DONE]\n\n",
                    "more_body": False})

    async def _watch(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self.finished:  # the server also reports the end of a connection it answered
                    self.disconnected = True
                    self.served.metrics.disconnects += 1
                    scope.cancel()
                return

    async def _answer(self, send: Send) -> None:
        sv, job = self.served, self.job
        try:
            ids = await self._ids()
        except BadRequest as e:
            await send_json(send, 400, error_body(400, str(e), e.param))
            return
        sv.metrics.generations += 1
        sv.metrics.prompt_tokens += len(ids)
        if job.stream:
            await self._stream(send, ids)
            return
        pieces: list[str] = []
        try:
            out = await run_job(sv.engine, job, ids, pieces.append)
        except (QnpipeError, ValueError) as e:
            if sv.closing.is_set():  # a second Ctrl-C stopped the engine under it: not a failure
                await send_json(send, 503, error_body(503, SHUTTING_DOWN))
                return
            self._log_failure(e)
            await send_json(send, 500, error_body(500, f"generation failed: {e}"))
            return
        sv.metrics.completion_tokens += out.completion_tokens
        self.outcome = out
        await send_json(send, 200, _ENC.encode(self._whole(out)))

    def _log_failure(self, e: Exception) -> None:
        # The client gets the error; the operator sees it too (a failed event log, a read error).
        print(f"qnpipe serve: {self.rid}: generation failed: {e}", file=sys.stderr, flush=True)

    async def _ids(self) -> list[int]:
        eng, job = self.served.engine, self.job
        if job.escaper is not None and isinstance(job.prompt, str) and has_marks(job.prompt):
            try:
                ids = await encode_marked(job.escaper, job.prompt, eng.encode)
            except ChatError as e:
                raise BadRequest(str(e), "messages") from None
        else:
            ids = await eng.encode(job.prompt) if isinstance(job.prompt, str) else list(job.prompt)
        limit = eng.args.max_position_embeddings
        if len(ids) + job.max_tokens > limit:
            field = "messages" if job.kind == "chat" else "prompt"
            raise BadRequest(f"{field}: the prompt is {len(ids)} tokens; with max_tokens={job.max_tokens} that is "
                             f"past the model's context of {limit} tokens", field)
        return ids

    def _whole(self, out: Outcome) -> s.ChatCompletion | s.Completion:
        model = self.served.model_id
        if self.job.kind == "chat":
            msg = s.OutMessage(role="assistant", content=out.content if out.content or not out.tool_calls else None,
                               tool_calls=out.tool_calls or None)
            return s.ChatCompletion(id=self.rid, created=self.created, model=model,
                                    choices=[s.ChatChoice(index=0, message=msg, finish_reason=out.finish_reason)],
                                    usage=out.usage)
        return s.Completion(id=self.rid, created=self.created, model=model, usage=out.usage,
                            choices=[s.TextChoice(index=0, text=self.job.echo + out.content,
                                                  finish_reason=out.finish_reason)])

    def _chunk(self, content: str | None = None, *, role: str | None = None, finish: str | None = None,
               tool_calls: list[s.StreamToolCall] | None = None) -> bytes:
        model = self.served.model_id
        if self.job.kind == "chat":
            obj: Any = s.ChatChunk(id=self.rid, created=self.created, model=model, choices=[s.ChunkChoice(
                index=0, delta=s.Delta(role=role, content=content, tool_calls=tool_calls), finish_reason=finish)])
        else:
            obj = s.Completion(id=self.rid, created=self.created, model=model,
                               choices=[s.TextChoice(index=0, text=content or "", finish_reason=finish)])
        return b"data: " + _ENC.encode(obj) + b"\n\n"

    def _usage_chunk(self, usage: s.Usage) -> bytes:
        model = self.served.model_id
        obj: Any = (s.ChatChunk(id=self.rid, created=self.created, model=model, choices=[], usage=usage)
                    if self.job.kind == "chat" else
                    s.Completion(id=self.rid, created=self.created, model=model, choices=[], usage=usage))
        return b"data: " + _ENC.encode(obj) + b"\n\n"

    async def _stream(self, send: Send, ids: list[int]) -> None:
        sv, job = self.served, self.job
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        first = self._chunk("", role="assistant") if job.kind == "chat" else b""
        if job.echo:
            first += self._chunk(job.echo)
        if first:
            await body(first)
        tx, rx = trio.open_memory_channel[str](math.inf)

        async def sender() -> None:
            async with rx:
                async for piece in rx:
                    more = [piece]
                    while True:  # what came while the last chunk was written goes out as one
                        try:
                            more.append(rx.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await body(self._chunk("".join(more)))

        out: Outcome | None = None
        failed = ""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            async with tx:
                try:
                    out = await run_job(sv.engine, job, ids, tx.send_nowait)
                except (QnpipeError, ValueError) as e:
                    if sv.closing.is_set():  # a second Ctrl-C stopped the engine under it: not a failure
                        failed = f"{SHUTTING_DOWN}: the answer was cut off"
                    else:
                        self._log_failure(e)
                        failed = f"generation failed: {e}"
        if out is None:
            await body(b"data: " + error_body(503 if sv.closing.is_set() else 500, failed) + b"\n\n")
        else:
            sv.metrics.completion_tokens += out.completion_tokens
            self.outcome = out
            tail = b""
            if out.tool_calls:
                calls = [s.StreamToolCall(index=i, id=c.id, function=c.function) for i, c in enumerate(out.tool_calls)]
                tail += self._chunk(None, tool_calls=calls)
            tail += self._chunk(None if job.kind == "chat" else "", finish=out.finish_reason)
            if job.include_usage:
                tail += self._usage_chunk(out.usage)
            await body(tail)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
