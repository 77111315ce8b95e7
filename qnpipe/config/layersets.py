"""Layer sets: the ``0-3,5,8`` syntax of the previous system's layer switches."""

from __future__ import annotations

import re
from collections.abc import Iterable

from qnpipe.errors import ConfigError

_LAYER_PART = re.compile(r"([0-9]+)\s*(?:-\s*([0-9]+))?")
# Far above any real model; stops "0-999999999" from building a huge set by mistake.
_MAX_LAYER = 65535


def parse_layer_set(text: str) -> tuple[int, ...]:
    """Parse a layer set such as ``"0-3,5,8"`` into sorted unique layer indices.

    Ranges are inclusive; empty text means all layers and gives ``()``. Empty parts
    (``"1,,2"``, a trailing comma) are skipped, as the previous system did.

    Raises:
      ConfigError: a part is not a non-negative number or an ascending range ``a-b``.
    """
    layers: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        m = _LAYER_PART.fullmatch(part)
        if m is None:
            why = "layer numbers are non-negative" if part.startswith("-") else "expected a layer number or a range a-b"
            raise ConfigError(f"bad layer set {text!r}: {part!r}: {why}; allowed: e.g. 0-3,5,8 (empty = all layers)")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo:
            raise ConfigError(f"bad layer set {text!r}: range {part!r} runs backwards; write {hi}-{lo}")
        if hi > _MAX_LAYER:
            raise ConfigError(f"bad layer set {text!r}: layer {hi} is above the maximum {_MAX_LAYER}")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def format_layer_set(layers: Iterable[int]) -> str:
    """The shortest ``parse_layer_set`` text for ``layers`` (e.g. ``(0, 1, 2, 5)`` -> ``"0-2,5"``)."""
    parts: list[str] = []
    run: list[int] = []
    for layer in sorted(set(layers)):
        if run and layer != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(layer)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


