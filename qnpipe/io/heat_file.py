"""The autopin heat file: routing heat per layer, persisted across runs.

JSON (msgspec) of `HeatFile`: ``{"format": "qnpipe-heat", "version": 1, "model_id": ...,
"layers": {"<layer>": {"<expert>": count}}}``; `model_id` is qnpipe.model.args.model_id
of the model that counted it; every layer must be one of the model's (its MoE layers and the
MTP layer, `num_hidden_layers`) and every expert id in 0..num_experts-1 (when the caller gives
them). `save_heat` writes a temporary file in the same directory,
fsyncs it, renames it over the old one and fsyncs the directory, so a crash at any moment
leaves the old file or the new one, never a torn one. `load_heat` never fails: a missing
file is a zero start; an unreadable (a FIFO, a directory, a device, larger than `HEAT_CAP`), corrupt,
other-version or other-model file, or one naming a layer or expert the model does not have,
is a zero start with one `HeatFileWarning` naming the path and the reason.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection
from pathlib import Path

import msgspec

from qnpipe.io.atomic import atomic_write
from qnpipe.io.files import MiB, read_capped

FORMAT = "qnpipe-heat"
VERSION = 1

Counts = dict[int, dict[int, int]]

# 48 layers x 512 experts of 20-digit counts is ~1 MB: a larger file is not a heat file.
HEAT_CAP = 16 * MiB


class _Unreadable(Exception):
    pass


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


def decode_heat(data: bytes, model_id: str, *, num_experts: int | None = None,
                layers: Collection[int] | None = None) -> Counts:
    """The counts in `data`; ValueError (the reason) when it is not this model's heat file.

    With `num_experts` / `layers`, an expert id outside 0..num_experts-1 or a layer not in
    `layers` is a reason too: pinning it would read a record the store does not have.
    """
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
    if layers is not None:
        bad = sorted(set(hf.layers) - set(layers))
        if bad:
            raise ValueError(f"layer {bad[0]} is not a MoE layer of this model (layers {sorted(layers)})")
    if num_experts is not None:
        for layer, row in sorted(hf.layers.items()):
            bad = sorted(e for e in row if not 0 <= e < num_experts)
            if bad:
                raise ValueError(f"layer {layer}: expert {bad[0]} out of range (the model has {num_experts} experts)")
    return {layer: dict(row) for layer, row in hf.layers.items()}


def load_heat(path: str | os.PathLike[str], model_id: str, *, num_experts: int | None = None,
              layers: Collection[int] | None = None) -> Counts:
    """The heat saved at `path` for `model_id`, or {} (with one warning when the file is unusable).

    `num_experts` and `layers` (the model's) make a file naming others unusable (`decode_heat`).
    """
    if not os.path.lexists(path):
        return {}  # the first run
    try:
        data = read_capped(path, HEAT_CAP, error=_Unreadable)
    except _Unreadable as e:
        reason = str(e).removeprefix(f"{Path(path)}: ")
        warnings.warn(f"{path}: heat file unreadable ({reason}); autopin starts from zero", HeatFileWarning,
                      stacklevel=2)
        return {}
    try:
        return decode_heat(data, model_id, num_experts=num_experts, layers=layers)
    except ValueError as e:
        warnings.warn(f"{path}: heat file ignored: {e}; autopin starts from zero", HeatFileWarning, stacklevel=2)
        return {}


def save_heat(path: str | os.PathLike[str], model_id: str, counts: Counts) -> None:
    """Replace `path` with `counts` atomically (temp file, fsync, rename, fsync of the directory). Raises OSError."""
    atomic_write(path, encode_heat(model_id, counts), fsync_dir=True)
