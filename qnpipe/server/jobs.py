"""A checked request becomes a Job: the prompt to run and how to run and answer it.

Every check names the request field at fault (BadRequest -> 400). Nothing in a request
is ever used as a path: `model` is only echoed back, never opened. Special-token text in a
chat request's strings stays text (qnpipe.chat.escape): no client string can open a turn.
"""

from __future__ import annotations

from typing import Any

import attrs
import msgspec

from qnpipe.chat.escape import Escaper, mark_request
from qnpipe.chat.template import filter_tools
from qnpipe.config.validate import check_min_p, check_seed, check_temperature, check_top_k, check_top_p
from qnpipe.errors import ChatError, QnpipeError
from qnpipe.server.schemas import ChatRequest, CompletionRequest, Message, NamedToolChoice

MAX_STOPS = 4


class BadRequest(QnpipeError):
    """A request the server will not run; `param` is the field at fault (the 400's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@attrs.define
class Limits:
    """The server's caps on what one request may ask for, and its defaults for what a request leaves out."""

    max_tokens_cap: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (408 otherwise)
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@attrs.define
class Job:
    """One generation and the shape of its answer."""

    kind: str  # "chat" or "completion"
    prompt: str | list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    tools: bool  # parse tool calls out of the output
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    echo: str = ""  # completions' echo=true: the prompt text, sent before the output
    escaper: Escaper | None = None  # chat: `prompt` was rendered from marked strings (qnpipe.chat.escape)


def _check(fn: Any, value: Any, name: str) -> Any:
    try:
        return fn(value, name=name)
    except ValueError as e:
        raise BadRequest(str(e), name) from None


def _sampling(req: ChatRequest | CompletionRequest, limits: Limits, max_tokens: int | None,
              max_name: str = "max_tokens") -> dict[str, Any]:
    if req.n != 1:
        raise BadRequest(f"n must be 1 (one choice per request), got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise BadRequest(f"{name} is not supported (give 0 or leave it out)", name)
    for name in ("logprobs", "top_logprobs"):
        if getattr(req, name) not in (None, False, 0):
            raise BadRequest(f"{name} is not supported by this server: it returns no log probabilities "
                             f"(leave {name} out)", name)
    fmt = req.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise BadRequest(f"response_format {kind or fmt!r} is not supported by this server: it does not constrain "
                         "the output to JSON (only {\"type\": \"text\"} is taken; ask for JSON in the prompt)",
                         "response_format")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens_cap)
    elif not 1 <= max_tokens <= limits.max_tokens_cap:
        raise BadRequest(f"{max_name} must be in 1..{limits.max_tokens_cap} (this server's cap), got {max_tokens}",
                         max_name)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise BadRequest("stop: a stop string is empty", "stop")
    def given(name: str, check: Any) -> Any:
        value = getattr(req, name)
        return getattr(limits, name) if value is None else _check(check, value, name)

    return {"max_tokens": max_tokens, "temperature": given("temperature", check_temperature),
            "top_p": given("top_p", check_top_p), "top_k": given("top_k", check_top_k),
            "min_p": given("min_p", check_min_p), "seed": _check(check_seed, req.seed, "seed"),
            "stops": stops, "stream": req.stream, "ignore_eos": req.ignore_eos,
            "include_usage": bool(req.stream_options and req.stream_options.include_usage)}


def _message(m: Message, i: int) -> dict[str, Any]:
    content = m.content
    if content is None and not (m.role == "assistant" and m.tool_calls):
        # Only an assistant message that calls tools may leave its content out (as OpenAI's API has it).
        raise BadRequest(f"messages[{i}].content: a {m.role} message needs content", f"messages[{i}].content")
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.tool_calls:
        if m.role != "assistant":
            raise BadRequest(f"messages[{i}].tool_calls: only an assistant message has tool calls",
                             f"messages[{i}].tool_calls")
        out["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
    if m.role == "tool":
        if m.tool_call_id is None:
            raise BadRequest(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                             f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _tools(req: ChatRequest, raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools to show the model, as the client wrote them (`raw`: the template renders their keys in order)."""
    tools = raw
    choice = req.tool_choice
    if choice == "none":
        return []
    if choice == "required":
        raise BadRequest("tool_choice 'required' is not supported (the model cannot be forced to call a tool); "
                         "use 'auto' or name one function", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = [t for t, typed in zip(tools, req.tools or [], strict=True) if typed.function.name == choice.function.name]
        if not named:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        return named
    return tools


def chat_job(req: ChatRequest, eng: Any, limits: Limits, raw_tools: list[dict[str, Any]] | None = None) -> Job:
    """The Job of a chat request: its messages and tools rendered by `eng.render_chat` (the model's
    chat template, tools kept by `chat.tools_allow`), every string marked first so that its
    special-token text is encoded as text (qnpipe.chat.escape). `raw_tools` are `req.tools` as
    decoded without a type (the keys in the client's order); default: `req.tools` re-encoded."""
    if not req.messages:
        raise BadRequest("messages is empty: give at least one message", "messages")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    if req.max_completion_tokens is not None:
        kw = _sampling(req, limits, req.max_completion_tokens, "max_completion_tokens")
    else:
        kw = _sampling(req, limits, req.max_tokens)
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    if raw_tools is None or len(raw_tools) != len(req.tools or []):
        raw_tools = [msgspec.to_builtins(t) for t in req.tools or []]
    tools = _tools(req, raw_tools)
    escaper = Escaper(eng.tokenizer)
    marked, marked_tools = mark_request(escaper, messages, tools or None)
    try:
        prompt = eng.render_chat(marked, marked_tools)
    except ChatError as e:
        raise BadRequest(str(e), _chat_param(str(e))) from None
    except QnpipeError as e:
        raise BadRequest(str(e), "messages") from None
    except Exception as e:  # the template's own errors (jinja2 raises its TemplateError, ...)
        raise BadRequest(f"messages: the chat template refused them ({type(e).__name__}: {e})", "messages") from None
    # The allowlist (chat.tools_allow) may have kept none of the tools sent: then there is nothing to call.
    shown = filter_tools(tools, eng.cfg.chat.tools_allow) if tools else []
    return Job(kind="chat", prompt=prompt, tools=bool(shown), escaper=escaper, **kw)


def _chat_param(message: str) -> str:
    """The field a ChatError names (`messages[2]: ...`, `tools[0]: ...`)."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return head if head.startswith(("messages", "tools")) else "messages"


def completion_job(req: CompletionRequest, vocab_size: int, limits: Limits) -> Job:
    """The Job of a completions request: its prompt as text or token ids, as given."""
    kw = _sampling(req, limits, req.max_tokens)
    prompt = req.prompt
    if not prompt:
        raise BadRequest("prompt is empty: give some text or at least one token id", "prompt")
    if isinstance(prompt, list):
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab_size:
                raise BadRequest(f"prompt[{i}]: token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                                 f"prompt[{i}]")
    if req.echo and not isinstance(prompt, str):
        raise BadRequest("echo needs the prompt as text", "echo")
    return Job(kind="completion", prompt=prompt, tools=False, echo=prompt if req.echo and isinstance(prompt, str)
               else "", **kw)
