"""The one place the server turns model output into OpenAI tool calls.

Qwen3-Next writes a call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
"""

from __future__ import annotations

import re
import secrets

import msgspec

from qnpipe.server.schemas import FunctionCall, OutToolCall

MARKER = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class _Call(msgspec.Struct):
    name: str
    arguments: dict[str, object] | str = msgspec.field(default_factory=dict)


def parse_tool_calls(text: str) -> list[OutToolCall]:
    """The well-formed calls in `text` (from its first MARKER on); [] when there is none."""
    out = []
    for m in _BLOCK.finditer(text):
        try:
            call = msgspec.json.decode(m.group(1), type=_Call)
        except msgspec.DecodeError:
            continue
        args = call.arguments if isinstance(call.arguments, str) else msgspec.json.encode(call.arguments).decode()
        out.append(OutToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(name=call.name, arguments=args)))
    return out
