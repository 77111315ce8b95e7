"""Prefix snapshots through the server: one long system prompt, different tool sets, the allowlist on."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from qnpipe.chat.template import render_prompt
from qnpipe.chat.tokenizer import encode, load_tokenizer
from tests.server.conftest import MODEL, ServerThread, metrics

SYSTEM = "You are a careful Python reviewer. " + " ".join(
    f"Rule {i}: prefer clear names over short ones, and test every branch of function_{i}." for i in range(24))


def _tool(name: str, what: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": what, "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": f"what to {what}"}},
        "required": ["query"]}}}


WEATHER = _tool("get_weather", "look up the weather")
SEARCH = _tool("search_docs", "search the documentation")
FILES = _tool("list_files", "list the files of a directory")
ALLOW = ("get_weather", "search_docs")
CHUNK = 32  # prefill chunk: the default (2) makes a cold prefill of this prompt take a minute here


def _messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _head_tokens() -> int:
    """A head that ends inside the tools block: the system prompt alone is shorter, so the tool set matters."""
    tok = load_tokenizer(MODEL)
    system_only = len(encode(tok, render_prompt(tok, _messages("x")[:1], add_generation_prompt=False)))
    with_tools = len(encode(tok, render_prompt(tok, _messages("x")[:1], [WEATHER, SEARCH], allow=ALLOW,
                                               add_generation_prompt=False)))
    assert system_only + 64 < with_tools
    return (with_tools - 16) // CHUNK * CHUNK  # a multiple of the prefill chunk


def _ask(srv: ServerThread, tools: list[dict[str, Any]], question: str) -> tuple[str, float]:
    """The answer, streamed, and its time to the first content (the test's own clock)."""
    t0 = time.perf_counter()
    first = None
    pieces = []
    for chunk in srv.client().chat.completions.create(model="m", messages=_messages(question), tools=tools,
                                                      temperature=0, max_tokens=16, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
    assert first is not None
    return "".join(pieces), first


@pytest.mark.slow
def test_same_system_prompt_different_tool_sets_resume_the_head_and_answer_as_a_fresh_server() -> None:
    head = _head_tokens()
    settings = {"snapshot_head_tokens": head, "tools_allow": ALLOW, "prefill_chunk_tokens": CHUNK}
    # The second request sends another tool set: one tool off the allowlist, the allowed ones swapped.
    second_tools = [copy.deepcopy(SEARCH), FILES, copy.deepcopy(WEATHER)]
    with ServerThread(**settings) as srv:
        _, ttft_first = _ask(srv, [WEATHER, SEARCH], "Review: def f(a): return a")
        before = metrics(srv)
        second, ttft_second = _ask(srv, second_tools, "Review: def g(b): return b * 2")
        after = metrics(srv)
    assert after["qnpipe_snapshot_hits_total"] - before["qnpipe_snapshot_hits_total"] == 1
    assert after["qnpipe_snapshot_tokens_reused_total"] - before["qnpipe_snapshot_tokens_reused_total"] >= head
    with ServerThread(**settings) as fresh:
        want, _ = _ask(fresh, second_tools, "Review: def g(b): return b * 2")
        assert metrics(fresh)["qnpipe_snapshot_hits_total"] == 0
    assert second == want
    print(f"head {head} tokens: time to first token {ttft_first * 1e3:.0f} ms cold, {ttft_second * 1e3:.0f} ms "
          f"resumed ({ttft_first / ttft_second:.1f}x shorter)")


@pytest.mark.slow
def test_without_the_allowlist_a_different_tool_set_does_not_resume_the_head() -> None:
    head = _head_tokens()
    with ServerThread(snapshot_head_tokens=head, prefill_chunk_tokens=CHUNK) as srv:
        _ask(srv, [WEATHER, SEARCH], "Review: def f(a): return a")
        before = metrics(srv)
        _ask(srv, [SEARCH, FILES, WEATHER], "Review: def g(b): return b * 2")
        after = metrics(srv)
    assert after["qnpipe_snapshot_hits_total"] == before["qnpipe_snapshot_hits_total"]
