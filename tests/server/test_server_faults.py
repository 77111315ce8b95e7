"""Load and faults on loopback: a bounded queue under 16 clients, a client killed mid-stream, bad requests."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from qnpipe.cli import main
from qnpipe.errors import QnpipeError
from qnpipe.server.jobs import Limits
from qnpipe.server.run import ServerOptions, check_options
from tests.deadline import deadline
from tests.server.conftest import MODEL, ServerThread, metrics, post

PROMPTS = ["Write a function that adds two numbers.", "Sort a list.", "Read a file.", "Reverse a string."]


@pytest.fixture(scope="module")
def queued() -> Iterator[ServerThread]:
    with ServerThread(ServerOptions(port=0, max_queue=4)) as srv:
        yield srv


def _ask(client: Any, i: int, max_tokens: int = 24) -> Any:
    return client.chat.completions.create(model=MODEL.name, messages=[{"role": "user", "content": PROMPTS[i % 4]}],
                                          temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True})


@pytest.mark.slow
def test_sixteen_clients_each_answered_once_or_429_and_the_queue_stays_bounded(queued: ServerThread) -> None:
    client = queued.client()
    want = [_ask(client, i).choices[0].message.content for i in range(4)]  # one at a time: the exact answers
    before = metrics(queued)
    results: dict[int, list[Any]] = {i: [] for i in range(16)}
    go = threading.Barrier(16)

    def one(i: int) -> None:
        c = queued.client()
        go.wait()
        try:
            results[i].append(_ask(c, i))
        except openai.RateLimitError as e:
            results[i].append(e)

    with deadline(60):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(len(r) == 1 for r in results.values())  # none lost, none answered twice
    answered = {i: r[0] for i, r in results.items() if not isinstance(r[0], openai.RateLimitError)}
    refused = [r[0] for r in results.values() if isinstance(r[0], openai.RateLimitError)]
    assert len(answered) >= 5  # the one running and the four queued behind it always get their turn
    for i, res in answered.items():  # each got its own answer, exact, despite the crowd
        assert res.choices[0].message.content == want[i % 4]
    assert len({res.id for res in answered.values()}) == len(answered)
    assert all(int(e.response.headers["retry-after"]) >= 1 for e in refused)
    after = metrics(queued)
    ok = 'qnpipe_requests_total{endpoint="/v1/chat/completions",code="200"}'
    busy = 'qnpipe_requests_total{endpoint="/v1/chat/completions",code="429"}'
    assert after[ok] - before[ok] == len(answered)
    assert after.get(busy, 0) - before.get(busy, 0) == len(refused)
    assert after["qnpipe_queue_depth_peak"] <= 4 and after["qnpipe_queue_depth"] == 0
    print(f"16 clients: {len(answered)} answered, {len(refused)} refused with 429, "
          f"peak queue {after['qnpipe_queue_depth_peak']:.0f} of 4")


KILLED_CLIENT = """
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0)
for chunk in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Sort a list."}],
                                       max_tokens=3000, stream=True, extra_body={"ignore_eos": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        print("streaming", flush=True)
"""


def test_client_killed_mid_stream_frees_the_engine_and_the_next_answer_is_exact(queued: ServerThread) -> None:
    client = queued.client()
    want = _ask(client, 1).choices[0].message.content
    before = metrics(queued)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, f"{queued.url}/v1"], stdout=subprocess.PIPE,
                            text=True)
    try:
        with deadline(60):
            assert proc.stdout is not None and proc.stdout.readline() == "streaming\n"
            proc.kill()  # SIGKILL: the connection just drops
            proc.wait()
            t0 = time.monotonic()
            while metrics(queued)["qnpipe_running"] != 0:
                time.sleep(0.05)
            freed_s = time.monotonic() - t0
    finally:
        proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()
    after = metrics(queued)
    assert after["qnpipe_client_disconnects_total"] - before["qnpipe_client_disconnects_total"] == 1
    # 3000 tokens take tens of seconds here; the engine was free well before.
    assert freed_s < 10
    assert after["qnpipe_completion_tokens_total"] == before["qnpipe_completion_tokens_total"]
    assert _ask(client, 1).choices[0].message.content == want
    print(f"engine free {freed_s:.2f} s after the client was killed")


def test_bad_requests_get_their_status_and_the_server_keeps_serving() -> None:
    key = "s3cret-key"
    opts = ServerOptions(port=0, api_key=key, limits=Limits(max_body_bytes=16 * 1024, max_tokens_cap=64))
    with ServerThread(opts) as srv:
        url = f"{srv.url}/v1/chat/completions"
        good = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong-key").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert post(url, good)[0] == 401
        status, body = post(url, b'{"messages": [', key)
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = post(url, json.dumps({"messages": "hi"}).encode(), key)
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = post(url, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "temprature": 0}).encode(), key)
        assert status == 400 and body["error"]["param"] == "temprature"
        status, body = post(url, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 65}).encode(), key)
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = post(url, json.dumps({"messages": [{"role": "user", "content": "x" * 20000}]}).encode(), key)
        assert status == 413
        status, body = post(url, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "temperature": -1}).encode(), key)
        assert status == 400 and body["error"]["param"] == "temperature"
        status, body = post(url, json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user"}]}).encode(),
                            key)
        assert status == 400 and body["error"]["param"] == "messages[1].content"
        with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as r:
            assert r.status == 200  # the probe needs no key
        status, body = post(url, good, key)
        assert status == 200 and body["choices"][0]["message"]["content"] is not None
        m = metrics(srv, key)
        assert m['qnpipe_requests_total{endpoint="/v1/chat/completions",code="401"}'] == 2
        assert m['qnpipe_requests_total{endpoint="/v1/chat/completions",code="400"}'] == 6
        assert m['qnpipe_requests_total{endpoint="/v1/chat/completions",code="413"}'] == 1


def test_binding_beyond_loopback_needs_an_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    check_options(ServerOptions(host="127.0.0.1"))
    check_options(ServerOptions(host="::1"))
    check_options(ServerOptions(host="0.0.0.0", api_key="k"))
    with pytest.raises(QnpipeError, match="needs --api-key"):
        check_options(ServerOptions(host="0.0.0.0"))
    assert main(["serve", str(MODEL), "--host", "192.168.1.5"]) == 2
    assert "not a loopback address" in capsys.readouterr().err


def test_a_client_that_leaves_while_queued_gives_its_place_up(queued: ServerThread) -> None:
    import socket

    host, port = queued.url.removeprefix("http://").rsplit(":", 1)
    before = metrics(queued)
    stream = queued.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Sort a list."}], max_tokens=3000, stream=True,
        extra_body={"ignore_eos": True})
    with deadline(60):
        next(iter(stream))  # the engine is busy with this one now
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        while metrics(queued)["qnpipe_queue_depth"] != 1:
            time.sleep(0.05)
        sock.close()  # leaves while waiting
        while metrics(queued)["qnpipe_queue_depth"] != 0:
            time.sleep(0.05)
        stream.close()  # and the one generating leaves too
        while metrics(queued)["qnpipe_running"] != 0:
            time.sleep(0.05)
    after = metrics(queued)
    left = 'qnpipe_requests_total{endpoint="/v1/chat/completions",code="499"}'
    assert after.get(left, 0) - before.get(left, 0) == 1  # the queued one never got an answer started
    assert after["qnpipe_client_disconnects_total"] - before["qnpipe_client_disconnects_total"] == 2
    assert after["qnpipe_generations_total"] - before["qnpipe_generations_total"] == 1
