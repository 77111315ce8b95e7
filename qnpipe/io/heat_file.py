"""The autopin heat file: routing heat per layer, persisted across runs.

JSON (msgspec) of `HeatFile`: ``{"format": "qnpipe-heat", "version": 1, "model_id": ...,
"layers": {"<layer>": {"<expert>": count}}}``; `model_id` is qnpipe.model.args.model_id
of the model that counted it. `save_heat` writes a temporary file in the same directory,
fsyncs it, renames it over the old one and fsyncs the directory, so a crash at any moment
leaves the old file or the new one, never a torn one. `load_heat` never fails: a missing
file is a zero start; an unreadable, corrupt, other-version or other-model file is a zero
start with one `HeatFileWarning` naming the path and the reason.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import msgspec

from qnpipe.atomic import atomic_write

FORMAT = "qnpipe-heat"
VERSION = 1

Counts = dict[int, dict[int, int]]


class HeatFileWarning(UserWarning):
    """The heat file could not be used (read) or written; autopin goes on without it."""


class HeatFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    version: int
    model_id: str
    layers: dict[int, dict[int, int]]


_decoder = msgspec.json.Decoder(HeatFile)


def encode_heat(model_id: str, counts: Counts) -> bytes:
    layers = {layer: dict(sorted(row.items())) for layer, row in sorted(counts.items())}
    return msgspec.json.encode(HeatFile(FORMAT, VERSION, model_id, layers))


def decode_heat(data: bytes, model_id: str) -> Counts:
    """The counts in `data`; ValueError (the reason) when it is not this model's heat file."""
    try:
        hf = _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a heat file ({e})") from None
    if hf.format != FORMAT:
        raise ValueError(f"format {hf.format!r}, expected {FORMAT!r}")
    if hf.version != VERSION:
        raise ValueError(f"version {hf.version}, this qnpipe reads version {VERSION}")
    if hf.model_id != model_id:
        raise ValueError(f"heat of another model (model_id {hf.model_id[:16]}..., this model is {model_id[:16]}...)")
    if any(c < 0 for row in hf.layers.values() for c in row.values()):
        raise ValueError("negative count")
    return {layer: dict(row) for layer, row in hf.layers.items()}


def load_heat(path: str | os.PathLike[str], model_id: str) -> Counts:
    """The heat saved at `path` for `model_id`, or {} (with one warning when the file is unusable)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        warnings.warn(f"{path}: heat file unreadable ({e}); autopin starts from zero", HeatFileWarning, stacklevel=2)
        return {}
    try:
        return decode_heat(data, model_id)
    except ValueError as e:
        warnings.warn(f"{path}: heat file ignored: {e}; autopin starts from zero", HeatFileWarning, stacklevel=2)
        return {}


def save_heat(path: str | os.PathLike[str], model_id: str, counts: Counts) -> None:
    """Replace `path` with `counts` atomically (temp file, fsync, rename, fsync of the directory). Raises OSError."""
    atomic_write(path, encode_heat(model_id, counts), fsync_dir=True)
