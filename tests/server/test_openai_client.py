"""The official openai client against `qnpipe serve`: models, chat and completions, streamed and not, tool calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import qnpipe
from qnpipe.stats import FinishReason, GenerateResult, GenerateStats
from tests.server.conftest import MODEL, ServerThread

USER = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[qnpipe.Engine]:
    with qnpipe.Engine(MODEL) as eng:
        yield eng


def test_models_lists_the_served_model(server: ServerThread) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL.name]


def test_chat_streamed_equals_whole_equals_engine_generate(server: ServerThread, engine: qnpipe.Engine) -> None:
    client = server.client()
    whole = client.chat.completions.create(model=MODEL.name, messages=USER, temperature=0, max_tokens=40)
    stream = client.chat.completions.create(model=MODEL.name, messages=USER, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    want = engine.generate(engine.render_chat(USER), max_tokens=40, temperature=0)
    assert want.text  # the comparison is not between empty strings
    assert whole.choices[0].message.content == want.text
    assert "".join(pieces) == want.text
    assert roles[0] == "assistant"
    reason = "stop" if want.stats.finish_reason is FinishReason.EOS else "length"
    assert whole.choices[0].finish_reason == finish == reason
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens == want.stats.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == want.stats.generated_tokens


def test_completions_streamed_equals_whole_equals_engine_generate(server: ServerThread, engine: qnpipe.Engine) -> None:
    client = server.client()
    prompt = "def fibonacci(n):\n"
    whole = client.completions.create(model=MODEL.name, prompt=prompt, temperature=0, max_tokens=30)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL.name, prompt=prompt, temperature=0, max_tokens=30, stream=True) if c.choices)
    want = engine.generate(prompt, max_tokens=30, temperature=0)
    assert whole.choices[0].text == streamed == want.text != ""


def test_stop_string_ends_the_text_before_it(server: ServerThread, engine: qnpipe.Engine) -> None:
    want = engine.generate("def fibonacci(n):\n", max_tokens=30, temperature=0).text
    stop = want[len(want) // 2:len(want) // 2 + 3]
    assert stop.strip()
    client = server.client()
    whole = client.completions.create(model=MODEL.name, prompt="def fibonacci(n):\n", temperature=0,
                                      max_tokens=30, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL.name, prompt="def fibonacci(n):\n", temperature=0, max_tokens=30, stop=stop, stream=True)
        if c.choices)
    assert whole.choices[0].text == streamed == want[:want.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


class ScriptedReplies:
    """The engine, except that `generate` answers with the next scripted text (the tiny model never calls a
    tool by itself); it records the prompt ids each request reached the engine with."""

    def __init__(self, eng: Any, replies: list[str]) -> None:
        self.eng = eng
        self.replies = replies
        self.prompts: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.eng, name)

    async def generate(self, ids: list[int], *, on_text: Any = None, partial: Any = None, **kw: Any) -> GenerateResult:
        self.prompts.append(list(ids))
        if not self.replies:
            return await self.eng.generate(ids, on_text=on_text, partial=partial, **kw)
        text = self.replies.pop(0)
        tokens = await self.eng.encode(text)
        for i in range(0, len(text), 7):  # in pieces, as the detokenizer hands them out
            on_text(text[i:i + 7])
        stats = GenerateStats(prompt_tokens=len(ids), generated_tokens=len(tokens) + 1, prefill_s=0.0, decode_s=0.0,
                              prefill_tok_s=0.0, decode_tok_s=0.0, peak_memory_bytes=0,
                              finish_reason=FinishReason.EOS)
        return GenerateResult(tokens=tuple(tokens), text=text, stats=stats)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_round_trip(engine: qnpipe.Engine) -> None:
    holder: dict[str, ScriptedReplies] = {}

    def wrap(eng: Any) -> ScriptedReplies:
        holder["s"] = ScriptedReplies(eng, ["Let me look.\n" + CALL, CALL])
        return holder["s"]

    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with ServerThread(wrap=wrap) as srv:
        client = srv.client()
        first = client.chat.completions.create(model=MODEL.name, messages=messages, tools=[WEATHER], temperature=0)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert msg.content == "Let me look.\n"
        assert msg.tool_calls is not None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

        # Streamed: the text before the call as content, the call as one tool_calls delta.
        chunks = list(client.chat.completions.create(model=MODEL.name, messages=messages, tools=[WEATHER],
                                                     temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert text == "" and len(deltas) == 1
        assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

        # The result goes back; the model (the real one now) sees the call and the result in its prompt.
        history = [*messages, {"role": "assistant", "content": msg.content,
                               "tool_calls": [{"id": call.id, "type": "function",
                                               "function": {"name": call.function.name,
                                                            "arguments": call.function.arguments}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
        last = client.chat.completions.create(model=MODEL.name, messages=history, tools=[WEATHER], temperature=0,
                                              max_tokens=8)
        assert last.choices[0].message.content is not None
    want = engine.render_chat([*messages, {"role": "assistant", "content": "Let me look.\n",
                                           "tool_calls": [{"function": {"name": "get_weather",
                                                                        "arguments": {"city": "Paris"}}}]},
                               {"role": "tool", "content": '{"temp_c": 18}'}], [WEATHER])
    assert engine.encode(want) == holder["s"].prompts[-1]
    assert "<tool_response>\n{\"temp_c\": 18}\n</tool_response>" in want


def test_malformed_tool_call_reaches_the_client_as_text() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'
    with ServerThread(wrap=lambda eng: ScriptedReplies(eng, [bad])) as srv:
        out = srv.client().chat.completions.create(model=MODEL.name, messages=[{"role": "user", "content": "hi"}],
                                                   tools=[WEATHER])
    assert out.choices[0].message.content == bad
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
