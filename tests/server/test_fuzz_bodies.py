"""Random request bodies: every one gets 200 or a 400 with a message, never a 500, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qnpipe.server.jobs import Limits
from qnpipe.server.run import ServerOptions
from tests.profiles import examples
from tests.server.conftest import ServerThread, post

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=False, width=32),
                    st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                                 "content": st.one_of(st.text(max_size=20), st.none(), VALUES)},
                                optional={"tool_calls": VALUES, "tool_call_id": SCALARS, "name": SCALARS})
FIELDS = {"messages": st.lists(MESSAGE, max_size=3), "prompt": st.one_of(st.text(max_size=20), VALUES),
          "temperature": SCALARS, "top_p": SCALARS, "max_tokens": SCALARS, "stop": VALUES, "seed": SCALARS,
          "stream": SCALARS, "tools": VALUES, "tool_choice": VALUES, "n": SCALARS, "echo": SCALARS,
          "bogus": SCALARS}
RANDOM = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))
# A valid body with one field replaced by anything: mostly answered, or refused naming that field.
GOOD = {"messages": [{"role": "user", "content": "hi"}], "prompt": "def f(x):", "temperature": 0, "max_tokens": 2}
MUTATED = st.sampled_from(sorted(FIELDS)).flatmap(lambda k: FIELDS[k].map(lambda v: {**GOOD, k: v}))
BODY = st.one_of(RANDOM, MUTATED)


@pytest.fixture(scope="module")
def small() -> Iterator[ServerThread]:
    with ServerThread(ServerOptions(port=0, limits=Limits(max_tokens_cap=3, default_max_tokens=2))) as srv:
        yield srv


# fewer: each example is an HTTP request
@pytest.mark.slow
@settings(examples(80), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY, endpoint=st.sampled_from(["chat/completions", "completions"]))
def test_any_body_is_answered_or_refused_with_a_400(small: ServerThread, body: dict[str, Any], endpoint: str) -> None:
    body = dict(body)
    body.pop("messages" if endpoint == "completions" else "prompt", None)
    if body.get("stream") is True:
        body["stream"] = False  # the SSE reply is not one JSON object; streaming has its own tests
    raw = json.dumps(body).encode()
    status, reply = post(f"{small.url}/v1/{endpoint}", raw)
    assert status in (200, 400), (status, reply)
    if status == 400:
        assert reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    else:
        assert reply["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
