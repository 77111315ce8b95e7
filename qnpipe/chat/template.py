"""Chat prompts under the model's own template: checked messages, tools filtered by an allowlist.

The server and `qnpipe chat` both call `render_prompt`. A prompt head (system turn + tools)
that renders to the same bytes on every request is what lets a prefix snapshot of it be
reused (qnpipe.model.snapshots), so `filter_tools` makes the rendered tool list depend only on the
allowlist (`chat.tools_allow`) and on the definitions of the allowed tools, not on which
other tools, or in which order, a caller sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qnpipe.chat import tokenizer as tokenizer_mod
from qnpipe.errors import ChatError

ROLES = ("system", "user", "assistant", "tool")


def tool_name(tool: Mapping[str, Any], index: int = 0) -> str:
    """The name of an OpenAI-style tool (`{"type": "function", "function": {"name": ...}}`) or a bare function schema.

    Raises ChatError naming the tool's index when it has no string name.
    """
    if not isinstance(tool, Mapping):
        raise ChatError(f"tools[{index}]: expected an object, got {type(tool).__name__}")
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ChatError(f"tools[{index}]: no function name (expected {{'type': 'function', "
                        f"'function': {{'name': ...}}}} or {{'name': ...}})")
    return name


def filter_tools(tools: Sequence[Mapping[str, Any]] | None, allow: Sequence[str] = ()) -> list[Mapping[str, Any]]:
    """The tools to render: with an `allow` list, exactly the allowed tools present, in `allow`'s order.

    `allow` empty keeps every tool in the caller's order. With an allowlist, tools not on it
    are dropped, and the kept ones are put in the allowlist's order, so two requests whose
    tool sets differ only outside the allowlist (or in order) render byte-identical heads.
    A name sent twice keeps its first definition. Raises ChatError for a tool without a name.
    """
    if not tools:
        return []
    named: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        named.setdefault(tool_name(tool, i), tool)
    if not allow:
        return list(named.values())
    return [named[n] for n in allow if n in named]


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise ChatError naming the first bad message (its index and what is wrong)."""
    if not messages:
        raise ChatError("messages is empty: give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatError(f"messages[{i}]: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}]: unknown role {role!r} (allowed: {', '.join(ROLES)})")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ChatError(f"messages[{i}] ({role}): content must be a string, got {type(content).__name__}")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ChatError(f"messages[{i}] ({role}): only assistant messages carry tool_calls")
        for j, call in enumerate(calls or ()):
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ChatError(f"messages[{i}].tool_calls[{j}]: no function name")


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None, *, allow: Sequence[str] = (),
                  add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` and `tools` under the model's own chat template.

    `messages` are OpenAI-style dicts (`role` system/user/assistant/tool, `content` a string,
    assistant `tool_calls` as `[{"function": {"name", "arguments"}}]`); `tools` are tool
    schemas, filtered by `allow` (pass `cfg.chat.tools_allow`; see `filter_tools`).
    `add_generation_prompt` ends the text with the assistant turn's opening.

    Raises ChatError naming the bad message or tool; TokenizerError when the tokenizer has
    no chat template.
    """
    check_messages(messages)
    kept = filter_tools(tools, allow)
    # Content None (an assistant turn of tool calls only, OpenAI style) renders as empty text.
    msgs = [{**m, "content": m.get("content") or ""} for m in messages]
    return tokenizer_mod.render_chat(tokenizer, msgs, [dict(t) for t in kept] or None, add_generation_prompt)
