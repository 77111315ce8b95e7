"""qnpipe's single typed configuration: ``load()`` builds the frozen ``Config`` tree, once, at start-up.

This is the only module of qnpipe that reads the environment (``os.environ``, when ``load`` is given
no ``env``); each actor then receives only its own sub-struct of the immutable result, so nothing is
read per token. The job is split three ways: ``qnpipe.config.fields`` (the table of fields, read from
the tree's types), ``qnpipe.config.sources`` (the environment, a TOML file and overrides, read into
settings) and this module (the settings merged, checked once by msgspec, errors translated to name
the key). Their public names stay importable from here, as before the split.

Precedence, lowest first: field defaults < TOML file < environment < overrides.
Environment names: ``QNPIPE_<SECTION>__<FIELD>`` and every bare switch name of the
previous system (``EXPERT_SLOTS``, ``PREFILL_CHUNK``, ... see ``qnpipe.config.aliases``); when
both spellings set one field, the ``QNPIPE_`` one wins. ``docs/config.md`` has the
full story and the generated reference tables.
"""

from __future__ import annotations

import enum
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from qnpipe.config.aliases import LEGACY_NAMES
from qnpipe.config.fields import COUNT_BOUNDS as COUNT_BOUNDS
from qnpipe.config.fields import ENV_PREFIX as ENV_PREFIX
from qnpipe.config.fields import FIELDS as _FIELDS
from qnpipe.config.fields import FieldSpec, describe_allowed, field_specs, unwrap
from qnpipe.config.layersets import format_layer_set, parse_layer_set
from qnpipe.config.pending import NOT_YET_IMPLEMENTED
from qnpipe.config.sources import ENV_CONFIG_FILE as ENV_CONFIG_FILE
from qnpipe.config.sources import (
    OVERRIDE_ALIASES,
    ReplacedSwitchWarning,
    Setting,
    env_settings,
    override_path,
    override_settings,
    toml_settings,
)
from qnpipe.config.sources import stacklevel as _stacklevel
from qnpipe.config.sources import warned_names as _warned_names
from qnpipe.config.tree import (
    ChatCfg,
    ComputeCfg,
    Config,
    DiagCfg,
    EvictPolicy,
    ForwardCfg,
    HiddenVariant,
    KvCfg,
    MemoryCfg,
    ModelCfg,
    ModelTier,
    MtpCfg,
    MtpHidden,
    MtpVerifyMode,
    PoolCfg,
    PredictAgg,
    PredictCfg,
    PrefetchInto,
    PrefixCfg,
    ReadBackend,
    ReadCfg,
    TraceCfg,
    check_evict_policy,
)
from qnpipe.errors import ConfigError

__all__ = [
    "ChatCfg", "ComputeCfg", "Config", "describe_allowed", "DiagCfg", "EvictPolicy", "explicit_settings",
    "field_specs", "check_evict_policy", "FieldSpec", "format_layer_set", "ForwardCfg", "HiddenVariant", "KvCfg", "ModelTier",
    "NOT_YET_IMPLEMENTED", "NotImplementedConfigWarning",
    "load", "MemoryCfg", "ModelCfg", "MtpCfg", "MtpHidden", "MtpVerifyMode", "OVERRIDE_ALIASES",
    "parse_layer_set", "PoolCfg", "PredictAgg", "PredictCfg", "PrefetchInto", "PrefixCfg", "ReadCfg",
    "ReadBackend", "ReplacedSwitchWarning", "LEGACY_NAMES", "TraceCfg", "with_overrides",
    "override_path", "rebuilt",
]

class NotImplementedConfigWarning(UserWarning):
    """A field was set whose feature does not exist yet (``qnpipe.config.pending``): it has no effect."""


def _coerce(spec: FieldSpec, value: object, source: str) -> object:
    """Turn text into the shape msgspec expects where strict=False alone does not."""
    t = spec.type
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(t, msgspec.inspect.BoolType) and type(value) is int and value in (0, 1):
        return bool(value)  # TOML [legacy] KV_QUANT = 1
    if (isinstance(t, msgspec.inspect.UnionType) and isinstance(value, str) and not value.strip()
            and any(isinstance(a, msgspec.inspect.NoneType) for a in t.types)):
        return None  # MOE_TOPK_OVERRIDE= means unset
    if isinstance(t, msgspec.inspect.VarTupleType) and isinstance(value, str):
        item, _ = unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            try:
                return parse_layer_set(value)
            except ConfigError as exc:
                raise ConfigError(f"bad value for {spec.path} (from {source}={value!r}): {exc}") from None
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return value


def _apply(tree: dict[str, Any], sources: dict[str, str], settings: Iterable[Setting]) -> None:
    for s in settings:
        section, field = s.path.split(".")
        tree.setdefault(section, {})[field] = _coerce(_FIELDS[s.path], s.value, s.source)
        sources[s.path] = f"{s.source}={s.value!r}"


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<where>[^`]*)`)?$", re.S)


def _over_cap(path: str, what: str, tree: Mapping[str, Any]) -> str | None:
    """"N is more than CAP" when msgspec refused the value at `path` for being above its count cap, else None."""
    cap = COUNT_BOUNDS.get(path)
    if cap is None or what != f"Expected `int` <= {cap}":
        return None
    section, field = path.split(".")
    try:  # msgspec took it as an int: an int, its text (environment, --set), or a whole float
        return f"{int(tree[section][field])} is more than {cap}"
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def _translate(exc: msgspec.ValidationError, tree: Mapping[str, Any], sources: Mapping[str, str]) -> ConfigError:
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any text
    what = m["what"]
    path = re.sub(r"\[\d+\]", "", (m["where"] or "").lstrip("."))
    if path in _FIELDS:
        origin = f" (from {sources[path]})" if path in sources else ""
        allowed = _FIELDS[path].allowed
        return ConfigError(f"bad value for {path}{origin}: {_over_cap(path, what, tree) or what}; allowed: {allowed}")
    # A cross-field rule of a section (__post_init__): list what was set there.
    set_here = [v for p, v in sources.items() if p.startswith(path + ".")] if path else []
    origin = f" (set by {'; '.join(set_here)})" if set_here else ""
    return ConfigError(f"invalid [{path or 'config'}]{origin}: {what}")


def _warn_not_implemented(cfg: Config) -> None:
    for path, feature in NOT_YET_IMPLEMENTED.items():
        section, field = path.split(".")
        value = getattr(getattr(cfg, section), field)
        if value == _FIELDS[path].default or path in _warned_names:
            continue
        _warned_names.add(path)
        warnings.warn(
            f"{path}={value!r} has no effect yet: {feature} is not implemented (docs/config.md)",
            NotImplementedConfigWarning,
            stacklevel=_stacklevel(),
        )


# The key in a Config's __dict__ (Config is a dict=True struct) under which `_finish` notes the settings given.
_GIVEN = "_qnpipe_given"


def _finish(tree: dict[str, Any], sources: Mapping[str, str]) -> Config:
    try:
        cfg = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise _translate(exc, tree, sources) from exc
    _warn_not_implemented(cfg)
    vars(cfg)[_GIVEN] = dict(sources)  # frozen fields; the __dict__ beside them is the struct's own
    return cfg


def _shown(value: object) -> str:
    return repr(value.value if isinstance(value, enum.Enum) else value)


def explicit_settings(cfg: Config) -> dict[str, str]:
    """The dotted paths of the settings `cfg` was given, each with where it came from: a TOML file, the
    environment, overrides (`--set`, the command's flags, `Engine(..., **overrides)`), `with_overrides`
    (``{"pool.evict_policy": "override pool.evict_policy='lru'"}``). For a Config made otherwise (its
    constructor, msgspec), every field away from its default counts as given."""
    given = dict(vars(cfg).get(_GIVEN, {}))
    for path, spec in _FIELDS.items():
        section, field = path.split(".")
        value = getattr(getattr(cfg, section), field)
        if path not in given and value != spec.default:
            given[path] = f"{path}={_shown(value)}"
    return given


def rebuilt(tree: Mapping[str, Any], given: Mapping[str, str]) -> Config:
    """The Config another process had: `tree` its ``msgspec.to_builtins``, `given` its ``explicit_settings``
    (which settings were given, and where: a plan's account names them), e.g. for a child that plans."""
    return _finish(dict(tree), given)


def load(
    toml_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build the ``Config``: defaults < TOML file < environment < overrides.

    Call it once at start-up. ``env=None`` reads ``os.environ`` (tests pass a dict);
    without ``toml_path`` the file named by ``QNPIPE_CONFIG`` is read, if set. Legacy
    switches that qnpipe replaces warn once per process (``ReplacedSwitchWarning``), and so
    does each field set away from its default whose feature does not exist yet
    (``NotImplementedConfigWarning``; the list is ``qnpipe.config.pending.NOT_YET_IMPLEMENTED``).

    Args:
      toml_path: TOML file with tables named after the sections (``[pool]``) and an
        optional ``[legacy]`` table of the previous system's names.
      env: environment; ``QNPIPE_<SECTION>__<FIELD>`` and bare legacy names are read,
        other variables ignored.
      overrides: dotted paths (``"pool.expert_slots"``), unique field names
        (``expert_slots``), ``OVERRIDE_ALIASES`` (``mtp``), legacy names, or a section
        name mapped to a dict.

    Raises:
      ConfigError: an unknown key (with the nearest valid name) or an invalid value
        (naming the key, where it came from, and what is allowed).
    """
    env = os.environ if env is None else env
    if toml_path is None and env.get(ENV_CONFIG_FILE):
        toml_path = env[ENV_CONFIG_FILE]
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if toml_path is not None:
        _apply(tree, sources, toml_settings(toml_path))
    _apply(tree, sources, env_settings(env))
    _apply(tree, sources, override_settings(overrides or {}))
    return _finish(tree, sources)


def with_overrides(cfg: Config, overrides: Mapping[str, object] | None = None, /, **kw: object) -> Config:
    """A copy of ``cfg`` with overrides applied, resolved exactly as in ``load``.

    Overrides come from the mapping and/or keywords (keywords win), e.g.
    ``with_overrides(cfg, expert_slots=32, mtp=True)``.

    Raises:
      ConfigError: an unknown key or an invalid value.
    """
    merged = {**(overrides or {}), **kw}
    tree: dict[str, Any] = msgspec.to_builtins(cfg)
    sources: dict[str, str] = dict(vars(cfg).get(_GIVEN, {}))  # what `cfg` was given stays given
    _apply(tree, sources, override_settings(merged))
    return _finish(tree, sources)
