"""The replay's own settings (`cost.*`, `device.*`, `replay.*`) beside the config's: their names, their
values from text (`--set`, a grid) and their bounds, each error naming the setting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from qnpipe.config import override_path
from qnpipe.errors import ConfigError
from qnpipe.io.sim_model import DeviceProfile
from qnpipe.replay.cost import CostModel
from qnpipe.replay.predictors import PREDICTORS

MAX_RECORD_NBYTES = 1 << 40
# The replay's own settings besides the cost and device fields (those follow their structs).
REPLAY_KEYS = ("replay.record_nbytes", "replay.predictor")


def check_record_nbytes(n: int, key: str = "replay.record_nbytes") -> int:
    """`n`, or ConfigError naming `key` when it is not in [1, MAX_RECORD_NBYTES]."""
    if not 1 <= n <= MAX_RECORD_NBYTES:
        raise ConfigError(f"{key}={n}: must be in [1, {MAX_RECORD_NBYTES}] (bytes of one expert record)")
    return n


def setting_value(key: str, text: Any) -> Any:
    """A replay setting's value (`cost.*`, `device.*`, `replay.*`) of its field's type, from text (`--set`, a grid).

    ConfigError names the key and the value; the range is checked with the struct (`CostModel.check`, ...)."""
    section, _, name = key.partition(".")
    types: dict[str, Any] = {"replay.record_nbytes": int, "replay.predictor": str}
    for struct, prefix in ((CostModel, "cost"), (DeviceProfile, "device")):
        types |= {f"{prefix}.{f.name}": f.type for f in msgspec.structs.fields(struct)}
    if key not in types:
        raise ConfigError(f"{key}: not a replay setting (known: {', '.join(sorted(types))})")
    want = types[key]
    if want not in (int, float, str):
        raise ConfigError(f"{key}: cannot be set from text (a cost file sets it)")
    try:
        return msgspec.convert(text.strip() if isinstance(text, str) else text, want, strict=False)
    except msgspec.ValidationError:
        raise ConfigError(f"{section}.{name}={text}: expected {'an integer' if want is int else 'a number'}") from None


def replay_keys() -> tuple[str, ...]:
    """Every replay setting a grid or `--set` may name: cost.*, device.*, replay.*."""
    return (*(f"cost.{f.name}" for f in msgspec.structs.fields(CostModel)),
            *(f"device.{f.name}" for f in msgspec.structs.fields(DeviceProfile)), *REPLAY_KEYS)


def resolve_key(key: str) -> str:
    """The dotted name of a grid or `--set` key: a replay setting, else a config field (as config resolves it)."""
    key = key.strip()
    own = replay_keys()
    if key in own:
        return key
    try:
        return override_path(key)
    except ConfigError:
        short = [k for k in own if k.partition(".")[2] == key]
        if len(short) == 1:
            return short[0]
        raise


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """The replay's own settings of a point (everything besides the config)."""

    device: DeviceProfile
    cost: CostModel
    record_nbytes: int | None = None
    predictor: str = "none"


def split_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config overrides, {"cost": ..., "device": ..., "replay": ...}) of resolved `settings`."""
    conf: dict[str, Any] = {}
    own: dict[str, dict[str, Any]] = {"cost": {}, "device": {}, "replay": {}}
    keys = set(replay_keys())
    for key, value in settings.items():
        if key in keys:
            section, _, name = key.partition(".")
            own[section][name] = value
        else:
            conf[key] = value
    return conf, own


def settings_of(own: Mapping[str, Mapping[str, Any]], base: Settings, where: str) -> Settings:
    """`base` with `own` (`split_settings`' second half, values as text) over it, each value checked;
    ConfigError names `where` (a grid point) and the setting."""
    try:
        typed = {section: {name: setting_value(f"{section}.{name}", v) for name, v in values.items()}
                 for section, values in own.items()}
        # typed above, so these convert; each value is then checked against its bounds, named
        cost = msgspec.convert({**msgspec.to_builtins(base.cost), **typed["cost"]}, CostModel, strict=False).check()
        device = msgspec.convert({**msgspec.to_builtins(base.device), **typed["device"]}, DeviceProfile,
                                 strict=False).check(where="device.")
        rep = typed["replay"]
        nbytes = rep.get("record_nbytes", base.record_nbytes)
        if nbytes is not None:
            check_record_nbytes(nbytes)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    predictor = str(rep.get("predictor", base.predictor))
    if predictor not in PREDICTORS:
        raise ConfigError(f"{where}: replay.predictor={predictor!r}: unknown, known: {', '.join(PREDICTORS)}")
    return Settings(device=device, cost=cost, record_nbytes=nbytes, predictor=predictor)


__all__ = ["MAX_RECORD_NBYTES", "REPLAY_KEYS", "Settings", "check_record_nbytes", "replay_keys", "resolve_key",
           "setting_value", "settings_of", "split_settings"]
