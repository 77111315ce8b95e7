"""Where qnpipe keeps what it measures of this machine: a user-level cache directory.

    user_cache_dir()                 # platformdirs' when installed, else $XDG_CACHE_HOME/qnpipe or ~/.cache/qnpipe
    device_profile_path(cfg)         # read.device_profile_path when set, else <user cache dir>/device-profile.json

Here because only qnpipe/config reads the environment (tests/test_no_env_reads.py). The measured
device profile is this machine's, not a model's or a working directory's: `qnpipe bench io` saves it
there and `--device measured` (the planner's default) reads it from there, whatever the current directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from qnpipe.config.tree import Config

DEVICE_PROFILE = "device-profile.json"


def user_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """qnpipe's user-level cache directory (not created here): `platformdirs.user_cache_dir("qnpipe")` where
    platformdirs is installed, else the XDG rule (`$XDG_CACHE_HOME/qnpipe`, else `~/.cache/qnpipe`;
    `~/Library/Caches/qnpipe` on macOS). `env`: a mapping in place of the environment (tests)."""
    env = os.environ if env is None else env
    if env is os.environ:
        try:
            import platformdirs  # pyright: ignore[reportMissingImports]  # optional: the XDG rule below without it
        except ImportError:
            pass
        else:
            return Path(platformdirs.user_cache_dir("qnpipe", appauthor=False))
    home = Path(env.get("HOME") or Path.home())
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "qnpipe"
    return Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "qnpipe"


def device_profile_path(cfg: Config, env: Mapping[str, str] | None = None) -> Path:
    """The measured device profile's file: `read.device_profile_path` when set, else the user cache's."""
    return Path(cfg.read.device_profile_path) if cfg.read.device_profile_path else user_cache_dir(env) / DEVICE_PROFILE


__all__ = ["DEVICE_PROFILE", "device_profile_path", "user_cache_dir"]
