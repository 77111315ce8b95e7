"""MTP speculation's statistics, under their old path: they are qnpipe.mtp_stats (beside qnpipe.stats,
whose GenerateStats holds them)."""

from __future__ import annotations

from qnpipe.mtp_stats import SpecStats

__all__ = ["SpecStats"]
