"""`tiny` (and `demo`) name the built-in trained model wherever MODEL_DIR is asked (issue 39 item 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.cli.model_names import resolve_builtin_model, resolve_model_dir
from tests.cli_harness import run_cli


def test_the_names_resolve_to_the_built_in_model_unless_a_path_of_that_name_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("tiny") == str(DEMO_MODEL_DIR) == resolve_model_dir("demo")
    assert resolve_model_dir("./tiny") == "./tiny" and resolve_model_dir("other") == "other"
    (tmp_path / "tiny").mkdir()  # `qnpipe make-tiny ./tiny` wrote one here: the path wins
    assert resolve_model_dir("tiny") == "tiny"
    args = resolve_builtin_model(argparse.Namespace(model_dir="demo", model=None, command="generate"))
    assert args.model_dir == str(DEMO_MODEL_DIR) and args.model is None


def test_generate_tiny_runs_the_built_in_model(tmp_path: Path) -> None:
    r = run_cli(["generate", "tiny", "-p", "def fib(n):", "-n", "4", "--json"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 4
