"""Only qnpipe/config/ may read (or write) the environment; everything else gets a Config."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qnpipe"
ALLOWED = PACKAGE / "config"
# Names, not text: comments and strings that mention os.environ are fine, code is not.
# Covers os.environ / os.getenv / environ[...] / from os import environ / putenv.
FORBIDDEN = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _env_uses(path: Path) -> list[str]:
    hits = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for tok in tokens:
        if tok.type == tokenize.NAME and tok.string in FORBIDDEN:
            hits.append(f"{path.relative_to(PACKAGE.parent)}:{tok.start[0]}: {tok.line.strip()}")
    return hits


def test_no_module_but_config_reads_the_environment() -> None:
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(ALLOWED)]
    hits = [hit for p in files for hit in _env_uses(p)]
    assert not hits, "only qnpipe/config/ may read the environment; found:\n" + "\n".join(hits)


def test_the_check_catches_env_reads(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n# os.environ in a comment is fine\nx = os.getenv('A')\ny = os.environ['B']\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert [h.split(":")[1] for h in _env_uses(bad)] == ["3", "4"]
    finally:
        PACKAGE = saved
