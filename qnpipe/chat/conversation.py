"""A conversation (system message + turns) and its JSON file (`qnpipe chat`'s /save and /load).

File: one JSON object `{"format": "qnpipe-conversation", "version": 1, "system": ..., "messages": [...]}`,
each message `{"role": "user" | "assistant" | "tool", "content": "...", "tool_calls": [...]}`
(`tool_calls` only on assistant messages, omitted when empty). Written to a temp name and renamed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from qnpipe.errors import ChatError
from qnpipe.io.atomic import atomic_write
from qnpipe.io.files import SMALL_CAP, read_capped

FORMAT = "qnpipe-conversation"
VERSION = 1


class FunctionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any]


class CallEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["user", "assistant", "tool"]
    content: str
    tool_calls: tuple[CallEntry, ...] = ()


class ConversationFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    version: int
    system: str | None
    messages: tuple[Message, ...]


class Conversation:
    """The system message and the turns of one chat, as the template takes them."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[dict[str, Any]] = []

    def messages(self) -> list[dict[str, Any]]:
        """The messages for `render_prompt`: the system message first (when set), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self.turns)

    def add(self, role: str, content: str, **extra: Any) -> None:
        self.turns.append({"role": role, "content": content, **extra})

    def reset(self) -> None:
        """Forget the turns; the system message stays."""
        self.turns.clear()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the conversation to `path` atomically (temp file + rename)."""
        path = Path(path)
        try:
            msgs = tuple(msgspec.convert(t, Message) for t in self.turns)
        except msgspec.ValidationError as e:
            raise ChatError(f"cannot save the conversation: {e}") from None
        data = msgspec.json.format(msgspec.json.encode(
            ConversationFile(format=FORMAT, version=VERSION, system=self.system, messages=msgs)), indent=1)
        atomic_write(path, data + b"\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Conversation:
        """The conversation in `path`; ChatError naming the file (and the bad key or message) otherwise."""
        path = Path(path)
        raw = read_capped(path, SMALL_CAP, error=ChatError)
        try:
            f = msgspec.json.decode(raw, type=ConversationFile)
        except msgspec.ValidationError as e:
            raise ChatError(f"{path}: not a conversation file: {e}") from None
        except msgspec.DecodeError as e:
            raise ChatError(f"{path}: not valid JSON ({e})") from None
        if f.format != FORMAT:
            raise ChatError(f"{path}: format {f.format!r}, expected {FORMAT!r}")
        if f.version != VERSION:
            raise ChatError(f"{path}: version {f.version}, this qnpipe reads version {VERSION}")
        conv = cls(f.system)
        conv.turns = list(msgspec.json.decode(msgspec.json.encode(f.messages)))  # plain dicts and lists
        return conv
