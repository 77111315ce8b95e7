"""`qnpipe serve` as a command: its help, and a real process that serves, then stops on SIGINT or SIGHUP."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from qnpipe.cli import build_parser, main
from tests.deadline import deadline
from tests.server.conftest import MODEL


def test_serve_help_teaches_flags_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for text in ("usage: qnpipe serve", "OpenAI", "--host", "--port", "--api-key", "--max-queue", "--max-tokens-cap",
                 "--max-body-bytes", "examples:", "curl", "docs/server.md"):
        assert text in out, text
    assert "qnpipe serve" in build_parser().format_help()


def test_bad_flags_exit_2_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", str(MODEL), "--port", "70000"])
    assert e.value.code == 2
    assert "65535" in capsys.readouterr().err
    assert main(["serve", str(MODEL), "--default-max-tokens", "100", "--max-tokens-cap", "10"]) == 2
    assert "--max-tokens-cap" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_serve_process_answers_then_stops_on_sigint(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "qnpipe", "serve", str(MODEL), "--port", "0", "--max-queue", "2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        with deadline(60):
            assert proc.stderr is not None
            url = None
            while url is None:
                line = proc.stderr.readline()
                assert line, "the server exited before it was ready"
                if m := re.search(r"qnpipe serve: \S+ on (http://127\.0\.0\.1:\d+)", line):
                    url = m.group(1)
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                assert json.loads(r.read())["status"] == "ok"
            req = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "def f(x):", "max_tokens": 4}).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert json.loads(r.read())["usage"]["prompt_tokens"] > 0
            proc.send_signal(sig)
            assert proc.wait() == 0
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_api_key_file_is_read_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.cli.serve_cmd import api_key

    key = tmp_path / "key"
    key.write_text("  k3y\n")
    args = build_parser().parse_args(["serve", str(MODEL), "--api-key-file", str(key)])
    assert api_key(args) == "k3y"
    key.write_text("\n")
    assert main(["serve", str(MODEL), "--api-key-file", str(key)]) == 2
    assert "the API key file is empty" in capsys.readouterr().err
    assert main(["serve", str(MODEL), "--api-key", "a", "--api-key-file", str(key)]) == 2
    assert "not both" in capsys.readouterr().err
