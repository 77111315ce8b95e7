"""Request sampling fields: top_k and min_p taken, the server's defaults for what a request leaves out,
and the server's own "not supported" for logprobs and response_format."""

from __future__ import annotations

import json

import msgspec
import pytest

from qnpipe.server.jobs import BadRequest, Limits, completion_job
from qnpipe.server.run import ServerOptions
from qnpipe.server.schemas import CompletionRequest
from tests.server.conftest import ServerThread, post


def _job(body: dict, limits: Limits | None = None):
    req = msgspec.json.decode(json.dumps({"prompt": "x", **body}), type=CompletionRequest)
    return completion_job(req, 1000, limits or Limits())


def test_fields_left_out_or_null_take_the_servers_defaults() -> None:
    limits = Limits(temperature=0.3, top_p=0.8, top_k=7, min_p=0.1)
    for body in ({}, {"temperature": None, "top_p": None, "top_k": None, "min_p": None}):
        job = _job(body, limits)
        assert (job.temperature, job.top_p, job.top_k, job.min_p) == (0.3, 0.8, 7, 0.1)
    job = _job({"temperature": 0.9, "top_p": 0.5, "top_k": 2, "min_p": 0.05}, limits)
    assert (job.temperature, job.top_p, job.top_k, job.min_p) == (0.9, 0.5, 2, 0.05)
    job = _job({})
    assert (job.temperature, job.top_p, job.top_k, job.min_p) == (1.0, 1.0, 0, 0.0)  # OpenAI's defaults


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"top_k": -1}, "top_k", "top_k must be an integer >= 0"),
    ({"min_p": 2}, "min_p", "min_p must be in [0, 1]"),
    ({"logprobs": True}, "logprobs", "logprobs is not supported by this server"),
    ({"logprobs": 3}, "logprobs", "logprobs is not supported by this server"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs is not supported by this server"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format 'json_object' is not supported by this server"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "ask for JSON in the prompt"),
])
def test_refused_fields_get_the_servers_own_message(body: dict, param: str, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        _job(body)
    assert e.value.param == param and needle in str(e.value)


def test_text_response_format_and_false_logprobs_are_taken() -> None:
    _job({"response_format": {"type": "text"}, "logprobs": False})


def test_server_default_top_k_1_samples_the_greedy_tokens() -> None:
    opts = ServerOptions(port=0, limits=Limits(temperature=3.0, top_k=1))
    with ServerThread(opts) as srv:
        url = f"{srv.url}/v1/completions"
        greedy = post(url, json.dumps({"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).encode())
        by_default = post(url, json.dumps({"prompt": "def f(x):", "max_tokens": 8, "seed": 1}).encode())
        free = post(url, json.dumps({"prompt": "def f(x):", "max_tokens": 8, "seed": 1, "top_k": 0}).encode())
        status, err = post(url, json.dumps({"prompt": "x", "logprobs": 1}).encode())
    assert greedy[0] == by_default[0] == free[0] == 200
    assert by_default[1]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]
    assert free[1]["choices"][0]["text"] != greedy[1]["choices"][0]["text"]  # the request's top_k wins
    assert status == 400 and err["error"]["param"] == "logprobs" and "not supported by this server" in err["error"]["message"]
