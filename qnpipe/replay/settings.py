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
from qnpipe.replay.predictors import PREDICTORS, PredictorOpts

MAX_RECORD_NBYTES = 1 << 40
# A step's experts at a layer are served in ascending id (the default) or in the order the router names them.
STEP_ORDERS = ("id", "router")
# The replay's own settings besides the cost and device fields (those follow their structs); the predictor's
# options (train_frac, recall, seed) are settings too, so a sweep can vary them.
REPLAY_KEYS = ("replay.record_nbytes", "replay.predictor", "replay.step_order", "replay.train_frac",
               "replay.recall", "replay.seed")
_REPLAY_TYPES: dict[str, Any] = {"replay.record_nbytes": int, "replay.predictor": str, "replay.step_order": str,
                                 "replay.train_frac": float, "replay.recall": float, "replay.seed": int}


def check_record_nbytes(n: int, key: str = "replay.record_nbytes") -> int:
    """`n`, or ConfigError naming `key` when it is not in [1, MAX_RECORD_NBYTES]."""
    if not 1 <= n <= MAX_RECORD_NBYTES:
        raise ConfigError(f"{key}={n}: must be in [1, {MAX_RECORD_NBYTES}] (bytes of one expert record)")
    return n


def setting_value(key: str, text: Any) -> Any:
    """A replay setting's value (`cost.*`, `device.*`, `replay.*`) of its field's type, from text (`--set`, a grid).

    ConfigError names the key and the value; the range is checked with the struct (`CostModel.check`, ...)."""
    section, _, name = key.partition(".")
    types: dict[str, Any] = dict(_REPLAY_TYPES)
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
    step_order: str = "id"
    opts: PredictorOpts = PredictorOpts()


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
    order = str(rep.get("step_order", base.step_order))
    if order not in STEP_ORDERS:
        raise ConfigError(f"{where}: replay.step_order={order!r}: unknown, known: {', '.join(STEP_ORDERS)}")
    opts = msgspec.structs.replace(base.opts, **{k: typed["replay"][k] for k in ("train_frac", "recall", "seed")
                                                 if k in typed["replay"]})
    try:
        check_opts(opts)
    except ConfigError as e:
        raise ConfigError(f"{where}: replay.{e}") from None
    return Settings(device=device, cost=cost, record_nbytes=nbytes, predictor=predictor, step_order=order, opts=opts)


def check_opts(opts: PredictorOpts) -> PredictorOpts:
    """`opts`, or ConfigError naming the option out of its range."""
    if not 0.0 <= opts.train_frac < 1.0:
        raise ConfigError(f"train_frac={opts.train_frac}: must be in [0, 1)")
    if not 0.0 <= opts.recall <= 1.0:
        raise ConfigError(f"recall={opts.recall}: must be in [0, 1]")
    if opts.seed < 0:
        raise ConfigError(f"seed={opts.seed}: must be >= 0")
    return opts


__all__ = ["MAX_RECORD_NBYTES", "REPLAY_KEYS", "STEP_ORDERS", "Settings", "check_opts", "check_record_nbytes", "replay_keys", "resolve_key",
           "setting_value", "settings_of", "split_settings"]
