"""Small versioned JSON files (a `kind` and a `version` beside the data): one writer, one reader.

The measured device profile (`qnpipe bench io`) and the fitted cost model (`qnpipe trace
fit-cost`) are such files. Each is written whole (temp name + rename) and read capped,
regular files only; a file of another kind or of a newer version is refused with the
caller's error class, naming the file and what would make a good one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec

from qnpipe.io.atomic import atomic_write
from qnpipe.io.files import CONFIG_CAP, read_capped


class Versioned(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def version(self) -> int: ...


T = TypeVar("T", bound=Versioned)


def save_versioned(path: str | os.PathLike[str], obj: msgspec.Struct, *, nofollow: bool = False) -> None:
    """Write `obj` as indented JSON to `path`, atomically (`nofollow`: qnpipe.io.atomic). Raises OSError."""
    atomic_write(Path(path), msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n", nofollow=nofollow)


def load_versioned(path: str | os.PathLike[str], type_: type[T], *, kind: str, version: int,
                   error: type[Exception], what: str, remedy: str) -> T:
    """The `type_` in the file at `path`, of `kind` and at most `version`.

    `error(message)` names the file when it is missing, not a regular file, too large, not
    JSON of `type_`, or of another kind or a newer version; `what` names the kind of file and
    `remedy` says how to make a good one (both go into the messages).
    """
    p = Path(path)
    if not p.exists():
        raise error(f"{p}: not found: {remedy}")
    data = read_capped(p, CONFIG_CAP, error=error)
    try:
        obj = msgspec.json.decode(data, type=type_)
    except msgspec.DecodeError as e:
        raise error(f"{p}: not a {what} ({e}); {remedy}") from None
    if obj.kind != kind or obj.version > version:
        raise error(f"{p}: kind {obj.kind!r} version {obj.version}: expected {kind!r} version <= {version}")
    return obj
