"""The device profile file: what `qnpipe bench io` saves and `--device measured` loads, and profiles by name.

    save_profile(device_profile_path(cfg), measured)   # a MeasuredProfile (qnpipe.io.measure)
    profile = named_profile("measured", cfg.read.device_profile_path)   # "": the user cache directory's
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from qnpipe.config.user_dirs import DEVICE_PROFILE, user_cache_dir
from qnpipe.errors import ConfigError, DeviceProfileError
from qnpipe.io.sim_model import PROFILES, DeviceProfile
from qnpipe.io.versioned import load_versioned, save_versioned

PROFILE_KIND = "qnpipe.device-profile"
PROFILE_VERSION = 1
MAX_SAMPLES = 10_000  # `qnpipe bench io` writes 20 by default (4 record sizes x 5 queue depths)


class ReadSample(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One cell: random reads of `record_nbytes` with `qd` in flight, for `seconds`."""

    record_nbytes: int
    qd: int
    reads_per_s: float
    bytes_per_s: float  # record bytes (not the aligned read length)


class MeasuredProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The profile file `qnpipe bench io` writes and `--device measured` reads."""

    kind: str = PROFILE_KIND
    version: int = PROFILE_VERSION
    profile: DeviceProfile
    latency_fit_residual_s: float  # rms of the qd-1 read times around the profile's service_s
    rate_fit_residual: float  # rms of log(measured / modelled reads per second) over every sample
    backend: str
    mode: str  # the reader's cache mode (direct I/O or not)
    samples: list[ReadSample]


# ---------------------------------------------------------------------------- the file


def save_profile(path: str | os.PathLike[str], measured: MeasuredProfile) -> None:
    """Replace `path` with `measured` as JSON atomically (temp file in the same directory, fsync, rename)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_versioned(path, measured)


def load_profile(path: str | os.PathLike[str]) -> MeasuredProfile:
    """The profile file at `path`; DeviceProfileError naming the file when absent, corrupt or invalid."""
    p = Path(path)
    measured = load_versioned(p, MeasuredProfile, kind=PROFILE_KIND, version=PROFILE_VERSION, error=DeviceProfileError,
                              what="device profile", remedy="run `qnpipe bench io` first (or set read.device_profile_path)")
    if len(measured.samples) > MAX_SAMPLES:
        raise DeviceProfileError(f"{p}: {len(measured.samples)} samples: a profile holds at most {MAX_SAMPLES} "
                                 "(`qnpipe bench io` writes one per record size and queue depth)")
    try:
        measured.profile.check(where="profile.")
    except ValueError as e:
        raise DeviceProfileError(f"{p}: {e}") from None
    return measured


def device_names() -> list[str]:
    """Every name `named_profile` knows: the built-in profiles and `measured`."""
    return sorted([*PROFILES, "measured"])


def named_profile(name: str, measured_path: str | os.PathLike[str]) -> DeviceProfile:
    """A built-in profile by name, or (`measured`) the one `qnpipe bench io` saved at `measured_path`
    (empty: the user cache directory's, qnpipe.config.user_dirs).

    ConfigError for an unknown name; DeviceProfileError when the measured file is absent or bad.
    """
    if name == "measured":
        return load_profile(measured_path or user_cache_dir() / DEVICE_PROFILE).profile
    if name not in PROFILES:
        raise ConfigError(f"device profile {name!r}: unknown, known: {', '.join(device_names())}")
    return PROFILES[name]


__all__ = ["PROFILE_KIND", "PROFILE_VERSION", "MeasuredProfile", "ReadSample", "device_names", "load_profile",
           "named_profile", "save_profile"]
