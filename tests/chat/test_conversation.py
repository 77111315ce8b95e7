"""Issue 13: `qnpipe chat`'s conversation file (/save, /load): round trip, and bad files named."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.chat.conversation import Conversation
from qnpipe.errors import ChatError


def test_round_trip_with_tool_calls(tmp_path: Path) -> None:
    conv = Conversation("Be brief.")
    conv.add("user", "list files")
    conv.add("assistant", "", tool_calls=[{"type": "function", "function": {"name": "ls", "arguments": {"d": "."}}}])
    conv.add("tool", "a.py b.py")
    conv.add("assistant", "Two files.")
    conv.save(tmp_path / "c.json")
    back = Conversation.load(tmp_path / "c.json")
    assert back.system == "Be brief." and back.turns == [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls", "arguments": {"d": "."}},
                                                             "type": "function"}]},
        {"role": "tool", "content": "a.py b.py"}, {"role": "assistant", "content": "Two files."}]
    assert back.messages()[0] == {"role": "system", "content": "Be brief."}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temp file left
    back.reset()
    assert back.messages() == [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize(("text", "error"), [
    ("{", "not valid JSON"),
    ('{"format": "qnpipe-conversation", "version": 1, "system": null, "messages": [{"role": "robot", '
     '"content": "x"}]}', r"messages\[0\]\.role"),
    ('{"format": "qnpipe-conversation", "version": 2, "system": null, "messages": []}', "version 2"),
    ('{"format": "other", "version": 1, "system": null, "messages": []}', "format 'other'"),
    ('{"format": "qnpipe-conversation", "version": 1, "system": null, "messages": [], "x": 1}', "unknown field"),
])
def test_a_bad_file_is_named(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ChatError, match=f"{path}.*{error}"):
        Conversation.load(path)
