"""`.ci/run` runs the README's test command verbatim, and the fast loop the README names is a real selection."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ci_command(script: str) -> str:
    """The command `.ci/run` runs: its last line that is not a comment or a shell setting."""
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    return lines[-1].strip()


def test_ci_runs_the_readme_command_verbatim() -> None:
    command = ci_command((ROOT / ".ci" / "run").read_text())
    assert f"```sh\n{command}\n```" in (ROOT / "README.md").read_text()
    assert command.endswith("-m pytest -n 2 --dist loadfile --durations=25")


def test_the_ci_commands_workers_come_with_the_test_extra() -> None:
    """`-n 2` is pytest-xdist's option: a fresh `pip install -e ".[test]"` must bring it."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(req.startswith("pytest-xdist>=") for req in extra), extra


def test_the_fast_loop_selects_by_a_registered_marker() -> None:
    pytest_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in pytest_cfg["addopts"]
    assert any(m.startswith("slow:") for m in pytest_cfg["markers"])
    assert '.venv/bin/python -m pytest -m "not slow"' in (ROOT / "README.md").read_text()


def test_the_check_catches_a_ci_command_that_drifted() -> None:
    script = "#!/usr/bin/env bash\nset -euo pipefail\ncd x\npython3 -m venv .venv && .venv/bin/python -m pytest -x\n"
    assert ci_command(script) == "python3 -m venv .venv && .venv/bin/python -m pytest -x"
    assert f"```sh\n{ci_command(script)}\n```" not in (ROOT / "README.md").read_text()
