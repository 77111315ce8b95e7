"""The flags every command that draws a figure shares: its title, axis labels, size and PNG resolution."""

from __future__ import annotations

import argparse

from qnpipe.errors import QnpipeError
from qnpipe.io.figure import FigureOptions


def add_figure_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure", "the plot's title, axis labels, size and resolution (default: the figure's own)")
    g.add_argument("--title", metavar="TEXT", help="the plot's title")
    g.add_argument("--xlabel", metavar="TEXT", help="the x axis label")
    g.add_argument("--ylabel", metavar="TEXT", help="the y axis label")
    g.add_argument("--size", metavar="WxH", help="the figure's width and height in inches, e.g. 3.5x2.6 (a journal "
                   "column)")
    g.add_argument("--dpi", type=int, metavar="N", help="PNG resolution in dots per inch (default 200; PDF and SVG "
                   "are vector)")


def parse_size(text: str) -> tuple[float, float]:
    """`WxH` in inches, each in 1..40."""
    w, sep, h = text.lower().partition("x")
    try:
        size = (float(w), float(h))
    except ValueError:
        size = (0.0, 0.0)
    if not sep or not all(1.0 <= v <= 40.0 for v in size):
        raise QnpipeError(f"--size {text}: expected WxH in inches, each 1 to 40, e.g. 6.4x4.2")
    return size


def figure_options(args: argparse.Namespace) -> FigureOptions:
    """The FigureOptions the flags of `add_figure_flags` ask for."""
    dpi = getattr(args, "dpi", None)
    if dpi is not None and not 50 <= dpi <= 1200:
        raise QnpipeError(f"--dpi {dpi}: expected 50 to 1200")
    size = getattr(args, "size", None)
    return FigureOptions(title=getattr(args, "title", None), xlabel=getattr(args, "xlabel", None),
                         ylabel=getattr(args, "ylabel", None), size=parse_size(size) if size else None, dpi=dpi)


__all__ = ["add_figure_flags", "figure_options", "parse_size"]
