"""Memory sizes as a user writes them: "8GB", "8GiB", "8000MB", "8G", "512MiB", "123456789".

GB means 2^30 bytes, as in the config (`memory.mlx_cache_limit_gb`, qnpipe.model.memory.GB) and as
macOS and RAM makers label memory (a "16 GB" Mac has 16 GiB): so "8GB", "8GiB" and "8G" are the same
8 x 2^30 bytes, "8000MB" is 8000 x 2^20. A number with no unit is bytes.
"""

from __future__ import annotations

import math
import re

from qnpipe.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
MAX_MEMORY = 2**50  # a petabyte: far above any machine, far below float trouble


def parse_memory(text: str, *, key: str = "--memory") -> int:
    """Bytes of a size like "8GB" (module doc); ConfigError naming `key` and the text when it is not one."""
    m = _RE.match(text)
    if m is None:
        raise ConfigError(f"{key}={text!r}: not a memory size (e.g. 8GB, 8GiB, 8000MB, 8G: GB = 2^30 bytes)")
    value = float(m.group(1))
    unit = m.group(2).lower()
    if m.group(3) and m.group(3).lower() == "ib" and not unit:
        raise ConfigError(f"{key}={text!r}: not a memory size (iB needs a prefix: KiB, MiB, GiB, TiB)")
    n = value * _UNITS[unit]
    if not (math.isfinite(n) and 1 <= n <= MAX_MEMORY):
        raise ConfigError(f"{key}={text!r}: must be between 1 byte and {MAX_MEMORY // 2**40} TiB")
    return int(n)


def fmt_bytes(n: float) -> str:
    """`n` bytes as GiB (or MiB below one GiB), the units `parse_memory` reads back."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


__all__ = ["MAX_MEMORY", "fmt_bytes", "parse_memory"]
