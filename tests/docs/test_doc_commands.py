"""Every `qnpipe` command line quoted in README.md and docs/*.md runs as written (issue 39 item 8).

A fenced block whose lines start with `qnpipe ` (or `$ qnpipe `) is a shell block: its qnpipe lines
run in order, each must exit 0, in one fresh directory per document (so a block may use what an
earlier block of the same document wrote). A backslash joins lines, `#` starts a comment and
`&&` chains commands, as in a shell. The directory holds the inputs the docs name
(`INPUTS`: `./tiny-qn`, a converted tiny model; `synth.qtrace` and `routes.qtrace`, small
synthetic routing logs), the hub is offline, and nothing else is given.

A block that cannot run here says so on the line before its fence: `<!-- not-run: reason -->`
(a listing of commands, a transcript of a session, a model of tens of GB, the network, a server
that runs until stopped). A reason is required; this test checks every marker has one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from tests.cli_harness import run_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<why>.*?)\s*-->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
HANG_GUARD_S = 300.0  # per command: a hang fails the test, never a slow machine
OFFLINE = (("HF_HUB_OFFLINE", "1"), ("MPLBACKEND", "Agg"))


@attrs.frozen
class Command:
    doc: str  # the document's path, relative to the repository
    line: int  # where the command starts
    argv: tuple[str, ...]  # after `qnpipe`

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: qnpipe {shlex.join(self.argv)}"


@attrs.frozen
class Block:
    doc: str
    line: int  # the opening fence
    lines: tuple[tuple[int, str], ...]  # (line number, text) inside the fence
    not_run: str | None  # the reason, when marked


def blocks(text: str, doc: str) -> Iterator[Block]:
    """The fenced blocks of `text` that hold a qnpipe command line, with their not-run reason if any."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        body: list[tuple[int, str]] = []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        if not any(t.lstrip().startswith(("qnpipe ", "$ qnpipe ")) for _, t in body):
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        m = NOT_RUN.match(before)
        yield Block(doc, start + 1, tuple(body), m["why"] if m else None)


def commands(block: Block) -> list[Command]:
    """The qnpipe command lines of a block, continuations joined, comments and `$ ` prompts dropped."""
    out: list[Command] = []
    pending, first = "", 0
    transcript = any(t.lstrip().startswith("$ ") for _, t in block.lines)  # then the other lines are output
    for no, text in block.lines:
        if transcript and not pending and not text.lstrip().startswith("$ "):
            continue
        if not pending:
            first = no
        pending += text.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        line, pending = pending.strip(), ""
        line = line.removeprefix("$ ")
        if not line.startswith("qnpipe "):
            continue  # another program's line (curl, python) or a command's output
        for part in _split_and(shlex.split(line, comments=True)):
            if part and part[0] == "qnpipe":
                out.append(Command(block.doc, first, tuple(part[1:])))
    return out


def _split_and(tokens: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for t in tokens:
        if t == "&&":
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def _all_blocks() -> list[Block]:
    return [b for p in DOCS for b in blocks(p.read_text(), str(p.relative_to(ROOT)))]


# --------------------------------------------------------------------------- the inputs the docs name


def _link_tree(src: Path, dst: Path) -> None:
    """A copy of a model directory whose files are hard links (commands write new files, never in place)."""
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def _synth(path: Path) -> None:
    from qnpipe.replay.synth import SynthSpec, write_synth

    write_synth(path, SynthSpec(layers=4, experts=64, top_k=4, tokens=200, seed=1, locality=0.3))


INPUTS: dict[str, Callable[[Path, Path], None]] = {
    "tiny-qn": lambda model, at: _link_tree(model, at),
    "synth.qtrace": lambda model, at: _synth(at),
    "routes.qtrace": lambda model, at: _synth(at),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tiny_qn4: Path) -> Path:
    return tiny_qn4


# --------------------------------------------------------------------------- the tests


def test_every_not_run_marker_gives_a_reason() -> None:
    bad = [f"{b.doc}:{b.line}" for b in _all_blocks() if b.not_run is not None and len(b.not_run) < 8]
    assert bad == [], f"a `<!-- not-run: reason -->` needs its reason: {bad}"


def test_the_parser_reads_blocks_as_a_shell_would() -> None:
    text = ("intro\n\n```sh\nqnpipe generate ./m -p 'a b' -n 2   # a comment\n"
            "qnpipe sweep x.qtrace --grid a=1,2 \\\n    --metric hit_rate\n"
            "curl http://x\nqnpipe trace fit-cost r -o c && qnpipe bench io\n```\n\n"
            "<!-- not-run: a listing, not command lines -->\n```\nqnpipe demo      generate\n```\n"
            "```\n$ qnpipe plan m --memory 1GB\nqnpipe plan: error: output\n```\n"
            "```python\nprint('no qnpipe line')\n```\n")
    got = list(blocks(text, "x.md"))
    assert [(b.line, b.not_run) for b in got] == [(3, None), (12, "a listing, not command lines"), (15, None)]
    assert [str(c) for c in commands(got[0])] == [
        "x.md:4: qnpipe generate ./m -p 'a b' -n 2", "x.md:5: qnpipe sweep x.qtrace --grid a=1,2 --metric hit_rate",
        "x.md:8: qnpipe trace fit-cost r -o c", "x.md:8: qnpipe bench io"]
    assert [str(c) for c in commands(got[2])] == ["x.md:16: qnpipe plan m --memory 1GB"]


def test_replay_help_names_the_mrc_csv_flag_the_parser_takes() -> None:
    r = run_cli(["replay", "--help"], timeout=HANG_GUARD_S)
    text = " ".join(r.stdout.decode().split())
    assert r.returncode == 0 and "Writes a CSV (--csv)" in text and "CSV (-o)" not in text, text


def _runnable_docs() -> list[str]:
    return sorted({b.doc for b in _all_blocks() if b.not_run is None})


@pytest.mark.slow
@pytest.mark.parametrize("doc", _runnable_docs())
def test_every_command_quoted_in_the_docs_runs_as_written(doc: str, model: Path, tmp_path: Path) -> None:
    todo = [c for b in _all_blocks() if b.doc == doc and b.not_run is None for c in commands(b)]
    assert todo, doc
    text = " ".join(" ".join(c.argv) for c in todo)
    written = {Path(c.argv[i + 1]).name for c in todo for i, a in enumerate(c.argv[:-1]) if a in ("--out", "-o")}
    for name, make in INPUTS.items():
        if name in text and name not in written:  # an input the document reads and does not make itself
            make(model, tmp_path / name)
    for c in todo:
        r = run_cli(list(c.argv), cwd=tmp_path, env=OFFLINE, timeout=HANG_GUARD_S)
        err = r.stderr.decode()
        assert r.returncode == 0, (f"{c}\nexit {r.returncode}; mark the block `<!-- not-run: reason -->` if it "
                                   f"cannot run on the tiny model offline\n{err[-3000:]}")
        assert "Traceback" not in err and "BlasWarning" not in err, f"{c}\n{err[-3000:]}"


def test_the_readme_first_screen_counts_the_families_the_registry_runs() -> None:
    from qnpipe.model.family.registry import FIRST, TESTED, UNSUPPORTED

    head = (ROOT / "README.md").read_text().split("## Quick start")[0]
    assert f"Qwen3-Next natively (with MTP), and {len(TESTED) - 1} more MoE families" in head
    assert all(f"`{t}`" in head for t in FIRST) and all(f"`{t}`" in head for t in UNSUPPORTED)
