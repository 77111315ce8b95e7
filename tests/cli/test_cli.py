"""The `qnpipe` command: help texts, make-tiny, generate, demo, and error reporting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qnpipe.cli import build_parser, main


@pytest.mark.parametrize(("cmd", "description"), [
    ("demo", "Generate from the built-in tiny model"), ("generate", "Generate a continuation of --prompt"),
    ("chat", "Multi-turn chat on the terminal"), ("make-tiny", "Write a tiny Qwen3-Next"),
])
def test_every_command_has_help_with_description(cmd: str, description: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: qnpipe {cmd}" in out and description in out and "options:" in out


def test_top_level_help_lists_commands_and_examples() -> None:
    text = build_parser().format_help()
    for cmd in ("demo", "generate", "chat", "make-tiny"):
        assert cmd in text
    assert "examples:" in text


def test_generate_json_from_token_ids(tiny_hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_hf), "--tokens", "5,6,7,8", "-n", "6", "--json", "--prefill-chunk", "0"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stats"]["prompt_tokens"] == 4
    assert 1 <= res["stats"]["generated_tokens"] <= 6
    assert len(res["tokens"]) <= 6


def test_generate_streams_text_then_stats(tiny_hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_hf), "-p", "def add(a, b):", "-n", "8", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert main(["generate", str(tiny_hf), "-p", "def add(a, b):", "-n", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out == text + "\n"  # streamed pieces add up to the whole text
    assert "prompt tokens" in captured.err and "decode" in captured.err
    assert main(["generate", str(tiny_hf), "-p", "def add(a, b):", "-n", "8", "--chat", "--system", "Be brief."]) == 0


def test_generate_bad_input_is_a_clear_error(tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_hf), "--tokens", "1,x"]) == 2
    assert "--tokens expects integers" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing"), "-p", "hi"]) == 2
    assert "config.json: not found" in capsys.readouterr().err
    assert main(["generate", str(tiny_hf), "-p", "hi", "--set", "forward.prefill_chunk_tokens=-3"]) == 2
    assert "prefill_chunk_tokens" in capsys.readouterr().err


def test_make_tiny_and_demo_on_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t"
    assert main(["make-tiny", str(out), "--layout", "mlx", "--bits", "4"]) == 0
    assert (out / "config.json").is_file()
    assert main(["make-tiny", str(out)]) == 2  # exists, no --force
    assert "exists" in capsys.readouterr().err
    assert main(["demo", "--model", str(out), "-n", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stats"]["generated_tokens"] >= 1


def test_module_entry_point_runs() -> None:
    r = subprocess.run([sys.executable, "-m", "qnpipe", "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.startswith("qnpipe ")


def test_demo_runs_the_shipped_trained_model_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.cli import DEMO_MODEL_DIR

    assert (DEMO_MODEL_DIR / "model.safetensors").is_file()
    assert main(["demo", "-n", "40", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stats"]["prompt_tokens"] > 5 and res["stats"]["generated_tokens"] >= 1
    assert res["text"].strip()


def test_chat_keeps_history_and_resets(tiny_hf: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.chat import tokenizer as tok_mod

    prompts: list[str] = []
    real_render = tok_mod.render_chat

    def spy(tokenizer, messages, tools=None, add_generation_prompt=True):
        text = real_render(tokenizer, messages, tools, add_generation_prompt)
        prompts.append(text)
        return text

    monkeypatch.setattr(tok_mod, "render_chat", spy)
    lines = iter(["first question", "second question", "/reset", "third question", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", str(tiny_hf), "--system", "Be brief.", "-n", "4", "-v"]) == 0
    assert len(prompts) == 3
    assert "first question" in prompts[1] and "second question" in prompts[1]  # history kept
    assert "first question" not in prompts[2] and "Be brief." in prompts[2]  # /reset keeps the system turn
    out = capsys.readouterr()
    assert out.out.count("assistant> ") == 3
    assert "prompt tokens" in out.err  # -v prints stats


def test_chat_ends_on_eof(tiny_hf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eof(prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    assert main(["chat", str(tiny_hf)]) == 0


@pytest.mark.parametrize("nest", [1, 3])
def test_an_error_inside_nursery_groups_is_said_as_itself(nest: int, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A lost rank or a disk error raised inside the actors' nurseries reaches the CLI wrapped in groups
    (next to the other tasks' Cancelled): one line naming it, exit 2, no traceback."""
    import trio

    from qnpipe.cli import store
    from qnpipe.errors import DistributedError

    def fails(_: object) -> int:
        e: BaseException = DistributedError("rank 1 was lost")
        for _ in range(nest):
            e = BaseExceptionGroup("Exceptions from Trio nursery", [trio.Cancelled._create(), e])  # type: ignore[attr-defined]
        raise e

    monkeypatch.setattr(store, "cmd_verify_store", fails)
    assert main(["verify-store", "nowhere"]) == 2
    assert capsys.readouterr().err == "qnpipe verify-store: error: rank 1 was lost\n"

    def other(_: object) -> int:
        raise ExceptionGroup("g", [ValueError("a bug")])

    monkeypatch.setattr(store, "cmd_verify_store", other)
    with pytest.raises(ExceptionGroup):  # not ours to explain: the traceback stays
        main(["verify-store", "nowhere"])
