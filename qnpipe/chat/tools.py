"""Tool calls in model output: Qwen's `<tool_call>{json}</tool_call>` blocks (the "hermes" form).

`parse_reply` splits a generated answer into its text and structured `ToolCall`s; a block
that is not a valid call becomes a `MalformedToolCall` in the result (reported to the
caller, never raised), so one bad call does not lose the rest of the answer.
`format_tool_call` writes a call the way the chat template renders it, so parsing what the
template rendered gives back the same calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One call the model asked for: the tool's `name` and its `arguments` (a JSON object)."""

    name: str
    arguments: dict[str, Any]


class MalformedToolCall(msgspec.Struct, frozen=True):
    """A `<tool_call>` block that is not a valid call: which block (`index`, 0-based), its raw `text`, why."""

    index: int
    text: str
    error: str


class ParsedReply(msgspec.Struct, frozen=True):
    """A generated answer: its `content` without the tool-call blocks, the valid calls, the malformed ones."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: tuple[MalformedToolCall, ...] = ()


def _decode_call(body: str) -> ToolCall:
    """The call in one block's JSON body; ValueError saying what is wrong."""
    try:
        obj = msgspec.json.decode(body.strip())
    except msgspec.DecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("no string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = msgspec.json.decode(args)
        except msgspec.DecodeError as e:
            raise ValueError(f"'arguments' is a string that is not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"'arguments' must be a JSON object, got {type(args).__name__}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise ValueError(f"unknown key {extra[0]!r} (a call has 'name' and 'arguments')")
    return ToolCall(name=name, arguments=args)


def parse_reply(text: str) -> ParsedReply:
    """Split generated `text` into content and tool calls; malformed blocks are reported in `.malformed`.

    A `<tool_call>` left open at the end (generation stopped inside it) is reported as
    malformed ("not closed"); its text is not part of the content either.
    """
    calls: list[ToolCall] = []
    bad: list[MalformedToolCall] = []
    pieces: list[str] = []
    pos = 0
    index = 0
    for m in _BLOCK.finditer(text):
        pieces.append(text[pos:m.start()])
        pos = m.end()
        body = m.group(1)
        try:
            calls.append(_decode_call(body))
        except ValueError as e:
            bad.append(MalformedToolCall(index=index, text=body, error=str(e)))
        index += 1
    rest = text[pos:]
    open_at = rest.find(OPEN)
    if open_at >= 0:
        bad.append(MalformedToolCall(index=index, text=rest[open_at + len(OPEN):],
                                     error=f"{OPEN} not closed by {CLOSE}"))
        rest = rest[:open_at]
    pieces.append(rest)
    return ParsedReply(content="".join(pieces).strip(), tool_calls=tuple(calls), malformed=tuple(bad))


def format_tool_call(call: ToolCall) -> str:
    """`call` as the chat template renders it (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`)."""
    # json.dumps with its default separators is what the template's `tojson` filter writes.
    args = json.dumps(call.arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def assistant_message(reply: ParsedReply) -> dict[str, Any]:
    """The history entry of a parsed answer (OpenAI shape), ready for `render_prompt` of the next turn."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in reply.tool_calls]
    return msg


def tool_result_message(content: str | Mapping[str, Any]) -> dict[str, Any]:
    """A `tool` message carrying a tool's result (an object is sent as its JSON text)."""
    text = content if isinstance(content, str) else json.dumps(dict(content), ensure_ascii=False)
    return {"role": "tool", "content": text}
