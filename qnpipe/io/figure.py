"""Writing a matplotlib figure as PNG, PDF or SVG: atomically, with the usual file mode, the same bytes each run.

PDF and SVG carry no creation date (matplotlib's metadata set to None) and SVG ids come from a
fixed salt, so a plot of the same data is the same file; the mode is what `qnpipe.io.atomic` gives every file (0o666 less the umask).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qnpipe.errors import ConfigError
from qnpipe.io.atomic import atomic_file

PLOT_FORMATS = ("png", "pdf", "svg")
DPI = 150  # PNG only: the vector formats do not depend on it
_NO_DATE: dict[str, dict[str, Any]] = {"png": {}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}


def check_format(fmt: str, where: str = "--plot-format") -> str:
    """`fmt`, or ConfigError naming `where` and the known formats."""
    if fmt not in PLOT_FORMATS:
        raise ConfigError(f"{where} {fmt}: unknown, known: {', '.join(PLOT_FORMATS)}")
    return fmt


def format_of(path: str | Path, default: str = "png") -> str:
    """The plot format a file name asks for by its suffix (.png, .pdf, .svg), else `default`."""
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in PLOT_FORMATS else default


def save(fig: Any, path: str | Path, fmt: str, *, dpi: int = DPI) -> Path:
    """Write `fig` to `path` in `fmt` (PLOT_FORMATS) through a temporary name; the path."""
    import matplotlib

    check_format(fmt)
    # svg.hashsalt: the SVG's element ids are otherwise random on each run
    with matplotlib.rc_context({"svg.hashsalt": "qnpipe"}), atomic_file(path) as f:
        fig.savefig(f, format=fmt, dpi=dpi, metadata=_NO_DATE[fmt])
    return Path(path)


__all__ = ["DPI", "PLOT_FORMATS", "check_format", "format_of", "save"]
