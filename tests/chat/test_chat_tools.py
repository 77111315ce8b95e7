"""Issue 13, chat: the model's own template with tools, the tool allowlist, tool-call parsing."""

from __future__ import annotations

from typing import Any

import pytest

from qnpipe.chat.template import filter_tools, render_prompt
from qnpipe.chat.tools import (
    ParsedReply,
    ToolCall,
    assistant_message,
    format_tool_call,
    parse_reply,
    tool_result_message,
)
from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.errors import ChatError


def _tool(name: str, desc: str = "") -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": desc or f"the {name} tool",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


READ, WRITE, SHELL, WEB = _tool("read_file"), _tool("write_file"), _tool("shell"), _tool("web_search")
SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def tok() -> Any:
    from qnpipe.chat.tokenizer import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR)


def test_two_requests_with_different_tool_sets_render_byte_identical_heads(tok: Any) -> None:
    allow = ("read_file", "write_file")
    a = render_prompt(tok, [SYSTEM, {"role": "user", "content": "one"}], [READ, WRITE, SHELL], allow=allow)
    b = render_prompt(tok, [SYSTEM, {"role": "user", "content": "two"}], [WEB, WRITE, READ], allow=allow)
    head_a, _, tail_a = a.partition("<|im_start|>user")
    head_b, _, tail_b = b.partition("<|im_start|>user")
    assert head_a.encode() == head_b.encode()
    assert '"name": "read_file"' in head_a and '"name": "write_file"' in head_a
    assert "shell" not in head_a and "web_search" not in head_a
    assert head_a.index("read_file") < head_a.index("write_file")  # the allowlist's order
    assert tail_a != tail_b
    # Without an allowlist the tool sets differ and so do the heads.
    c = render_prompt(tok, [SYSTEM, {"role": "user", "content": "one"}], [READ, WRITE, SHELL])
    assert "shell" in c and c != a


def test_the_template_is_the_models_own(tok: Any) -> None:
    text = render_prompt(tok, [SYSTEM, {"role": "user", "content": "hi"}], [READ])
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert "<tools>\n" + '{"type": "function"' in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # No tools: the plain system turn.
    plain = render_prompt(tok, [SYSTEM, {"role": "user", "content": "hi"}], [SHELL], allow=("read_file",))
    assert plain == "<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                    "<|im_start|>assistant\n"


def test_filter_tools() -> None:
    assert filter_tools(None) == [] and filter_tools([READ, SHELL]) == [READ, SHELL]
    assert filter_tools([SHELL, READ, WRITE], ("write_file", "read_file", "absent")) == [WRITE, READ]
    bare = {"name": "bare", "parameters": {}}
    assert filter_tools([bare, _tool("bare", "second")], ("bare",)) == [bare]  # first definition wins
    with pytest.raises(ChatError, match=r"tools\[1\]: no function name"):
        filter_tools([READ, {"type": "function", "function": {}}])


def test_bad_messages_are_named(tok: Any) -> None:
    with pytest.raises(ChatError, match=r"messages\[1\]: unknown role 'robot'"):
        render_prompt(tok, [SYSTEM, {"role": "robot", "content": "x"}])
    with pytest.raises(ChatError, match=r"messages\[0\] \(user\): content must be a string"):
        render_prompt(tok, [{"role": "user", "content": 3}])
    with pytest.raises(ChatError, match=r"messages\[1\].tool_calls\[0\]: no function name"):
        render_prompt(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{}]}])
    with pytest.raises(ChatError, match=r"messages\[0\] \(user\): only assistant messages carry tool_calls"):
        render_prompt(tok, [{"role": "user", "content": "a", "tool_calls": []}])
    # Content None (OpenAI's tool-call-only turn) is empty text.
    none = render_prompt(tok, [{"role": "system", "content": None}, {"role": "user", "content": "a"}], [READ])
    assert none.startswith("<|im_start|>system\n\n\n# Tools")
    # A later system message is a turn of its own in this template.
    later = render_prompt(tok, [{"role": "user", "content": "a"}, SYSTEM])
    assert later.endswith("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ChatError, match="messages is empty"):
        render_prompt(tok, [])


def test_tool_calls_round_trip_through_the_template(tok: Any) -> None:
    calls = (ToolCall("read_file", {"path": "a.py"}), ToolCall("shell", {"cmd": "ls -l", "n": [1, 2.5, None]}))
    reply = parse_reply("Reading it.\n" + "\n".join(format_tool_call(c) for c in calls))
    assert reply.tool_calls == calls and reply.content == "Reading it." and not reply.malformed
    # What the template renders for an assistant turn with these calls parses back to them.
    msgs = [{"role": "user", "content": "go"}, assistant_message(reply),
            tool_result_message({"text": "print(1)"}), tool_result_message("ok")]
    text = render_prompt(tok, msgs, add_generation_prompt=False)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_reply(turn) == reply
    assert turn == "Reading it.\n" + "\n".join(format_tool_call(c) for c in calls)
    assert '<tool_response>\n{"text": "print(1)"}\n</tool_response>\n<tool_response>\nok\n</tool_response>' in text


def test_malformed_tool_calls_are_reported_not_raised() -> None:
    text = ('a <tool_call>\n{"name": "read_file", "arguments": {"path": "x"}}\n</tool_call>'
            '<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>'
            '<tool_call>["read_file"]</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"name": "f", "arguments": 3}</tool_call> b '
            '<tool_call>{"name": "late", "argu')
    r = parse_reply(text)
    assert r.tool_calls == (ToolCall("read_file", {"path": "x"}), ToolCall("f", {"a": 1}))
    assert [(m.index, m.error.split(" (")[0]) for m in r.malformed] == [
        (1, "not valid JSON"), (2, "expected a JSON object, got list"), (3, "no string 'name'"),
        (5, "'arguments' must be a JSON object, got int"), (6, "<tool_call> not closed by </tool_call>")]
    assert r.malformed[0].text == '{"name": "read_file", "arguments": {"path": '
    assert r.content == "a  b"
    assert parse_reply("no calls here") == parse_reply("no calls here  ")
    assert parse_reply("plain").tool_calls == () and parse_reply("plain").content == "plain"


def test_the_engine_renders_with_the_configured_allowlist() -> None:
    import qnpipe

    with qnpipe.Engine(DEMO_MODEL_DIR, tools_allow="shell, read_file") as eng:
        text = eng.render_chat([SYSTEM, {"role": "user", "content": "hi"}], [READ, WRITE, SHELL])
    assert text.index('"name": "shell"') < text.index('"name": "read_file"') and "write_file" not in text


def test_a_call_survives_the_streaming_detokenizer(tok: Any) -> None:
    """`<tool_call>` is a token the detokenizer keeps: what `generate` returns as text parses to the call."""
    from qnpipe.chat.tokenizer import encode

    call = ToolCall("read_file", {"path": "src/main.py", "lines": [1, 20]})
    text = "Let me look.\n" + format_tool_call(call)
    ids = encode(tok, text)
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert parse_reply(detok.text) == parse_reply(text) == ParsedReply("Let me look.", (call,))
