"""The capped whole-file reads, under their old path: they are the leaf `qnpipe.files` (imported
by qnpipe.config, which sits below qnpipe.io)."""

from __future__ import annotations

from qnpipe.files import (
    CONFIG_CAP,
    INDEX_CAP,
    SMALL_CAP,
    KiB,
    MiB,
    check_regular,
    open_regular,
    read_capped,
    read_text_capped,
)

__all__ = ["CONFIG_CAP", "INDEX_CAP", "SMALL_CAP", "KiB", "MiB", "check_regular", "open_regular", "read_capped",
           "read_text_capped"]
