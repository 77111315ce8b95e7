"""TextGate: stop strings and the tool-call marker, whatever way the text is cut into pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qnpipe.server.textgate import TextGate


def _run(gate: TextGate, pieces: list[str]) -> str:
    out = "".join(gate.feed(p) for p in pieces)
    return out + gate.finish()


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


TEXT = "def f(x):\n    return x + 1\n\n<tool_call>\n{}\n</tool_call>\nEND tail"


@given(st.lists(st.integers(0, 200), max_size=12))
def test_stop_string_cuts_the_content_however_it_is_split(cuts: list[int]) -> None:
    gate = TextGate(["return x"])
    assert _run(gate, _cut(TEXT, cuts)) == "def f(x):\n    "
    assert gate.stopped


@given(st.lists(st.integers(0, 200), max_size=12))
def test_tool_marker_holds_the_call_back_as_tool_text(cuts: list[int]) -> None:
    gate = TextGate((), "<tool_call>")
    content = _run(gate, _cut(TEXT, cuts))
    assert content == gate.content == "def f(x):\n    return x + 1\n\n"
    assert gate.tool_text == TEXT[len(content):]


@given(st.lists(st.integers(0, 200), max_size=12))
def test_without_stops_everything_passes(cuts: list[int]) -> None:
    assert _run(TextGate(), _cut(TEXT, cuts)) == TEXT


def test_a_possible_stop_prefix_is_held_until_decided() -> None:
    gate = TextGate(["STOP"])
    assert gate.feed("abc ST") == "abc "
    assert gate.feed("AR") == "STAR"
    assert gate.feed(" ST") == " "
    assert gate.feed("OP more") == ""
    assert gate.stopped and gate.content == "abc STAR "
    assert gate.feed("ignored") == "" and gate.finish() == ""


def test_earliest_stop_wins_and_a_stop_inside_a_tool_call_ends_it() -> None:
    gate = TextGate(["b", "a"])
    assert _run(gate, ["xxab"]) == "xx"
    gate = TextGate(["</tool_call>"], "<tool_call>")
    assert _run(gate, ["hi <tool_call>{}</tool_call> more"]) == "hi "
    assert gate.tool_text == "<tool_call>{}" and gate.stopped
