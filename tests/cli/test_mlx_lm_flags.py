"""mlx-lm's flag names: taken where they mean the same, explained where not; a bad flag gets its command's usage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from qnpipe.cli import DEMO_MODEL_DIR, build_parser, main
from qnpipe.cli.common import config_overrides
from tests.cli_harness import run_cli

M = str(DEMO_MODEL_DIR)


def _parse(argv: list[str]) -> dict:
    ns = vars(build_parser().parse_args(argv))
    return {k: v for k, v in ns.items() if k != "func"}


# (mlx-lm's command line, qnpipe's own for the same thing)
SAME = [
    (["generate", "--model", M, "-p", "x"], ["generate", M, "-p", "x"]),
    (["generate", M, "-p", "x", "-m", "7"], ["generate", M, "-p", "x", "--max-tokens", "7"]),
    (["generate", M, "-p", "x", "--temp", "0.5"], ["generate", M, "-p", "x", "--temperature", "0.5"]),
    (["generate", M, "-p", "x", "--system-prompt", "S"], ["generate", M, "-p", "x", "--system", "S"]),
    (["generate", M, "-p", "x", "--prefill-step-size", "512"], ["generate", M, "-p", "x", "--prefill-chunk", "512"]),
    (["chat", "--model", M, "-m", "9", "--system-prompt", "S"], ["chat", M, "-n", "9", "--system", "S"]),
    (["serve", "--model", M, "--temp", "0.7", "--max-tokens", "99"],
     ["serve", M, "--temperature", "0.7", "--default-max-tokens", "99"]),
    (["convert", "--hf-path", "a/b", "--mlx-path", "out"], ["convert", "a/b", "--out", "out"]),
]


@pytest.mark.parametrize(("mlx_lm", "qnpipe"), SAME, ids=[" ".join(a[:1] + a[2:]) for a, _ in SAME])
def test_mlx_lm_names_parse_as_qnpipes(mlx_lm: list[str], qnpipe: list[str]) -> None:
    a, b = _parse(mlx_lm), _parse(qnpipe)
    assert a == b
    assert config_overrides(build_parser().parse_args(mlx_lm)) == config_overrides(build_parser().parse_args(qnpipe))


def test_prefill_step_size_and_kv_bits_are_settings() -> None:
    args = build_parser().parse_args(["generate", M, "-p", "x", "--prefill-step-size", "64", "--kv-bits", "4"])
    assert config_overrides(args) == {"forward.prefill_chunk_tokens": 64, "kv.quantize": True, "kv.k_bits": 4,
                                      "kv.v_bits": 4}


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "usage", "needle"), [
    (["generate", M, "--top-kk", "5"], "usage: qnpipe generate", "did you mean --top-k?"),
    (["generate", M, "--sytem", "S"], "usage: qnpipe generate", "did you mean --system?"),
    (["chat", M, "--max-tokns=5"], "usage: qnpipe chat", "did you mean --max-tokens?"),
    (["serve", M, "--prot", "80"], "usage: qnpipe serve", "did you mean --port?"),
    (["generate", M, "--max-kv-size", "512"], "usage: qnpipe generate", "keeps the whole context"),
    (["generate", M, "--draft-model", "d"], "usage: qnpipe generate", "--mtp"),
    (["convert", "a", "--out", "o", "--q-bits", "4"], "usage: qnpipe convert", "--bits N"),
    (["bench", "io", "--sise", "1"], "usage: qnpipe bench io", "unrecognized arguments: --sise"),
])
def test_a_bad_flag_gets_its_commands_usage_and_a_suggestion(argv: list[str], usage: str, needle: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(argv, capsys)
    assert err.startswith(usage) and needle in err and "usage: qnpipe [-h]" not in err


def test_model_given_twice_or_not_at_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert "MODEL_DIR given twice" in _bad(["generate", M, "--model", "other", "-p", "x"], capsys)
    assert "required: MODEL_DIR (or --model MODEL_DIR)" in _bad(["generate", "-p", "x"], capsys)
    assert "required: SRC (or --hf-path SRC)" in _bad(["convert", "--out", "o"], capsys)
    _parse(["generate", M, "--model", M, "-p", "x"])  # the same directory twice is fine


def test_help_says_why_qnpipe_differs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "mlx-lm, which applies the template" in out and "--max-kv-size has no counterpart" in out
    assert "--top-k" in out and "--min-p" in out and "--system-prompt" in out and "--prefill-step-size" in out


def test_generate_with_mlx_lm_flags_and_the_prompt_on_stdin() -> None:
    common = ["-m", "6", "--temp", "0.9", "--top-k", "5", "--min-p", "0.05", "--seed", "3", "--json",
              "--set", "kv.group_size=32"]  # the tiny model's head_dim
    a = run_cli(["generate", "--model", M, "-p", "-", "--system-prompt", "Be terse.", "--prefill-step-size", "8",
                 "--kv-bits", "4", *common], stdin=b"def add(a, b):")
    assert a.returncode == 0, a.stderr.decode()
    b = run_cli(["generate", M, "-p", "def add(a, b):", "--system", "Be terse.", "--chat", "--prefill-chunk", "8",
                 "--set", "kv.quantize=true", "--set", "kv.k_bits=4", "--set", "kv.v_bits=4", *common])
    assert b.returncode == 0, b.stderr.decode()
    ra, rb = json.loads(a.stdout), json.loads(b.stdout)
    assert ra["tokens"] == rb["tokens"] and 1 <= len(ra["tokens"]) <= 6


def test_prompt_dash_with_nothing_on_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert "standard input was empty" in _bad(["generate", M, "-p", "-"], capsys)


def test_flags_doc_lists_every_name_taken_or_explained() -> None:
    from qnpipe.cli.flags import MLX_LM_ONLY

    doc = (Path(__file__).resolve().parents[2] / "docs" / "mlx-lm-flags.md").read_text()
    for name in [*MLX_LM_ONLY, "--model", "--max-tokens", "--temp", "--system-prompt", "--prefill-step-size",
                 "--hf-path", "--mlx-path", "--top-k", "--min-p", "--kv-bits"]:
        assert f"`{name}" in doc, name
