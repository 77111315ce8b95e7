"""Device profiles and cost models from published measurements, shipped as data (qnpipe/data/devices/).

    dev = load_published("m5")        # dev.device (a DeviceProfile), dev.cost (a CostModel), dev.sources

Each file names, for every figure, the public measurement it comes from and how the figure follows from it
(or that it was derived, and from what); what has no public figure is listed under `unpublished` and set to
0 or left to the planner. `qnpipe plan --device NAME` (and `make_plans(device=NAME)`) takes a published
profile's name beside the built-in ones; without `--cost` it plans with the profile's cost model too
(qnpipe.plan.make.resolve_device and the cost it falls back to).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from qnpipe.errors import DeviceProfileError
from qnpipe.io.sim_model import DeviceProfile
from qnpipe.replay.cost import CostModel

PUBLISHED_DIR = Path(__file__).resolve().parents[1] / "data" / "devices"
KIND = "qnpipe.published-device"


class Source(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One figure: its value, the public measurement it comes from, and how it sets the profile or cost."""

    figure: str
    value: str
    source: str
    how: str


class PublishedDevice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: str
    version: int
    name: str
    machine: str
    device: DeviceProfile
    cost: CostModel
    sources: list[Source]
    unpublished: list[str]


def published_names() -> list[str]:
    """The names of the shipped published profiles (their files' stems)."""
    return sorted(p.stem for p in PUBLISHED_DIR.glob("*.json")) if PUBLISHED_DIR.is_dir() else []


def load_published(name: str) -> PublishedDevice:
    """The published profile `name`; DeviceProfileError naming the file when it is not one."""
    path = PUBLISHED_DIR / f"{name}.json"
    if name not in published_names():
        raise DeviceProfileError(f"published device {name!r}: unknown, known: {', '.join(published_names())}")
    try:
        dev = msgspec.json.decode(path.read_bytes(), type=PublishedDevice)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DeviceProfileError(f"{path}: not a published device profile: {e}") from None
    if dev.kind != KIND or dev.name != name:
        raise DeviceProfileError(f"{path}: kind {dev.kind!r} and name {dev.name!r}: expected {KIND!r} and {name!r}")
    try:
        dev.device.check(where=f"{path}: device.")
        dev.cost.check(where=f"{path}: cost.")
    except ValueError as e:
        raise DeviceProfileError(str(e)) from None
    return dev


def published_cost(device: object) -> CostModel | None:
    """The cost model of `device` when it names a published profile, else None."""
    return load_published(device).cost if isinstance(device, str) and device in published_names() else None


__all__ = ["KIND", "PUBLISHED_DIR", "PublishedDevice", "Source", "load_published", "published_cost", "published_names"]
