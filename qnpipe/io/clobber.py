"""The one check that no output of a command is one of its inputs.

Every command that writes a file calls `check_outputs` before any work, with each output and
each input named by what gave it (`--csv`, `LOG`, `--config`, `trace.event_log_path`) and the
model directories it reads. An output is refused when it is an input (the same path, a hard
link to it, a symbolic link to it, or a path that resolves to it), when it lies inside a
model directory the command reads or is a hard link to one of that directory's files (except
the files the command is meant to write there: `own`), or when two outputs are one file.

An existing output is compared by identity (device and inode, links followed), so every way
of naming the same file is caught; an output that does not exist yet by its resolved path,
so a dangling symbolic link at the output is followed to where the write would land.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from qnpipe.errors import OutputError

PathLike = str | os.PathLike[str]
Named = tuple[str, PathLike | None]  # (what gave it: a flag, a positional's name or a setting; the path)

# A model directory is a few hundred files; the walk that looks for hard links to them stops
# here, so a command given a home directory as its model does not walk the disk.
WALK_CAP = 100_000


class _File(NamedTuple):
    what: str
    path: Path
    real: Path  # links resolved, as far as the path exists
    ident: tuple[int, int] | None  # (st_dev, st_ino) of what it names, links followed; None when absent


def _file(what: str, p: PathLike) -> _File:
    path = Path(p).expanduser()
    try:
        st = os.stat(path)
        ident: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        ident = None
    return _File(what, path, Path(os.path.realpath(path)), ident)


def _named(items: Iterable[Named]) -> list[_File]:
    return [_file(what, p) for what, p in items if p is not None and str(p) != ""]


def _same(a: _File, b: _File) -> bool:
    if a.ident is not None and b.ident is not None:
        return a.ident == b.ident
    return a.real == b.real


def _how(o: _File, i: _File) -> str:
    if os.path.abspath(o.path) == os.path.abspath(i.path):
        return ""
    if o.real == i.real:
        return " (through a symbolic link)"
    return " (a hard link to it)"


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def _model_files(root: Path) -> Iterator[tuple[Path, tuple[int, int]]]:
    """(path, identity) of the files under `root`, links followed; at most WALK_CAP entries looked at."""
    seen = 0
    for d, dirs, files in os.walk(root):
        for name in files:
            seen += 1
            if seen > WALK_CAP:
                return
            p = Path(d) / name
            try:
                st = os.stat(p)
            except OSError:
                continue
            yield p, (st.st_dev, st.st_ino)
        seen += len(dirs)
        if seen > WALK_CAP:
            return


def check_outputs(outputs: Iterable[Named], inputs: Iterable[Named] = (), *, models: Iterable[Named] = (),
                  own: Iterable[PathLike] = ()) -> None:
    """Raise OutputError, naming the output, its flag and the input, when an output would replace an input.

    `outputs` and `inputs` are (what gave it, path) pairs; None or "" paths are skipped. `models`
    are directories whose every file is an input (a model directory, its expert store); `own` the
    files and directories inside them the command writes by design (the recorded log, the heat
    file, the plan cache), which may also replace an input of their own name (a plan read from
    the recorded log before the new one is recorded).
    """
    outs = _named(outputs)
    ins = _named(inputs)
    dirs = _named(models)
    mine = [Path(os.path.realpath(Path(p).expanduser())) for p in own if str(p)]
    for n, o in enumerate(outs):
        for prev in outs[:n]:
            if _same(o, prev):
                raise OutputError(f"{o.what} {o.path}: is also {prev.what} {prev.path}: one would replace the "
                                  f"other; give each output its own file")
        if any(_inside(o.real, m) for m in mine):
            continue
        for i in ins:
            if _same(o, i):
                raise OutputError(f"{o.what} {o.path}: is the input {i.what} {i.path}{_how(o, i)}: writing it "
                                  f"would destroy that input; give another file name")
        for m in dirs:
            if _inside(o.real, m.real):
                link = f" (a symbolic link to {o.real})" if os.path.islink(o.path) else ""
                raise OutputError(f"{o.what} {o.path}{link}: is inside the model directory {m.path} ({m.what}), "
                                  f"which this command reads; give a path outside it")
            if o.ident is None:
                continue
            for f, ident in _model_files(m.real):
                if ident == o.ident and not any(_inside(Path(os.path.realpath(f)), d) for d in mine):
                    raise OutputError(f"{o.what} {o.path}: is the file {f} of the model directory {m.path} "
                                      f"({m.what}){_how(o, _file('', f))}: writing it would break the model; "
                                      f"give another file name")


__all__ = ["check_outputs"]
