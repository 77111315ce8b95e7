"""Where settings come from: the environment, a TOML file and overrides, each read into a list of settings.

A setting is a dotted field path, the value as given (text from the environment, a TOML value, a
Python object), and where it came from, for error messages. Names are resolved here (qnpipe's
``QNPIPE_<SECTION>__<FIELD>``, the previous system's switch names, override keys); an unknown name is
an error suggesting the nearest valid one. Values are checked later, once, by ``qnpipe.config.loader``.
This module is handed the environment as a mapping; only ``loader.load`` reaches for ``os.environ``.
"""

from __future__ import annotations

import difflib
import os
import sys
import tomllib
import warnings
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from qnpipe.config.aliases import LEGACY_BY_NAME, Kind, LegacyName
from qnpipe.config.fields import ENV_PREFIX, FIELDS, FLAT, SECTIONS
from qnpipe.errors import ConfigError
from qnpipe.files import CONFIG_CAP, read_capped

__all__ = [
    "ENV_CONFIG_FILE", "OVERRIDE_ALIASES", "ReplacedSwitchWarning", "Setting", "env_settings", "override_path",
    "override_settings", "stacklevel", "toml_settings", "warned_names",
]

# Names the TOML file when load() gets no toml_path; not a Config field.
ENV_CONFIG_FILE = "QNPIPE_CONFIG"
_NOT_FIELDS = frozenset({ENV_CONFIG_FILE})

# Convenience override names (Engine(model_dir, mtp=True)); flat field names that are
# unique across the tree work without an entry here.
OVERRIDE_ALIASES: Mapping[str, str] = {
    "mtp": "mtp.enabled",
    "model": "model.model_dir",
    "kv_quant": "kv.quantize",
    "prefill_chunk": "forward.prefill_chunk_tokens",
    "cache_limit_gb": "memory.mlx_cache_limit_gb",
    "wired_limit_gb": "memory.mlx_wired_limit_gb",
}


class ReplacedSwitchWarning(UserWarning):
    """A switch of the previous system was set that qnpipe's architecture replaces (no effect)."""


class Setting(NamedTuple):
    path: str  # qnpipe dotted path
    value: object
    source: str  # where it came from, for error messages


# What has warned in this process: legacy switch names and, from the loader, field paths.
warned_names: set[str] = set()


def stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside qnpipe: the user's call."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__")).partition(".")[0] == "qnpipe":
        level, frame = level + 1, frame.f_back
    return level


def _warn_replaced(legacy: LegacyName, source: str) -> None:
    if legacy.name in warned_names:
        return
    warned_names.add(legacy.name)
    warnings.warn(
        f"legacy switch {legacy.name} ({source}) has no effect in qnpipe: it meant {legacy.meaning!r}; "
        f"replaced by {legacy.target}",
        ReplacedSwitchWarning,
        stacklevel=stacklevel(),
    )


def _suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _legacy_setting(name: str, value: object, source: str) -> Setting | None:
    legacy = LEGACY_BY_NAME[name]
    if legacy.kind is Kind.REPLACED:
        _warn_replaced(legacy, source)
        return None
    return Setting(legacy.target, value, source)


def _same_value(a: object, b: object) -> bool:
    def norm(v: object) -> object:
        s = str(v).strip().lower()
        return {"1": "true", "0": "false"}.get(s, s)

    return norm(a) == norm(b)


def _check_legacy_conflicts(settings: list[Setting]) -> list[Setting]:
    # Two legacy names for one field (EXPERT_NOCACHE, STREAM_BLOB_NOCACHE) must agree.
    seen: dict[str, Setting] = {}
    for s in settings:
        prev = seen.get(s.path)
        if prev is not None and not _same_value(prev.value, s.value):
            raise ConfigError(
                f"{s.path} is set twice with different values: {prev.source}={prev.value!r} "
                f"and {s.source}={s.value!r}; set one of them"
            )
        seen[s.path] = s
    return settings


def env_settings(env: Mapping[str, str]) -> list[Setting]:
    """The settings of an environment: ``QNPIPE_<SECTION>__<FIELD>`` and the legacy switch names."""
    legacy_hits: list[Setting] = []
    own_hits: list[Setting] = []
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            if key in _NOT_FIELDS:
                continue
            section, _, field = key[len(ENV_PREFIX):].partition("__")
            path = f"{section.lower()}.{field.lower()}"
            if path not in FIELDS:
                # Compare without the shared prefix, which would make every name look close.
                flat = FLAT.get(key[len(ENV_PREFIX):].lower(), [])
                close = _suggest(key[len(ENV_PREFIX):], [s.env_name[len(ENV_PREFIX):] for s in FIELDS.values()])
                hint = f"; did you mean {FIELDS[flat[0]].env_name}?" if len(flat) == 1 else close.replace(
                    "mean ", "mean " + ENV_PREFIX)
                what = f"no qnpipe field {path}" if field else f"not of the form {ENV_PREFIX}<SECTION>__<FIELD>"
                raise ConfigError(f"unknown environment variable {key}={raw!r}: {what}{hint} (see docs/config.md)")
            own_hits.append(Setting(path, raw, f"environment variable {key}"))
        elif key in LEGACY_BY_NAME:
            s = _legacy_setting(key, raw, f"environment variable {key}")
            if s is not None:
                legacy_hits.append(s)
    # The QNPIPE_ spelling comes last so it wins over the bare legacy name.
    return _check_legacy_conflicts(legacy_hits) + own_hits


def toml_settings(toml_path: str | os.PathLike[str]) -> list[Setting]:
    """The settings of a TOML file: tables named after the sections, and a ``[legacy]`` table."""
    where = os.fspath(toml_path)
    try:  # a FIFO, a directory or a device given as the file is refused, never read (or waited on)
        raw = read_capped(where, CONFIG_CAP, error=ConfigError)
    except ConfigError as exc:
        raise ConfigError(f"cannot read config file {exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {where} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at "
                          f"offset {exc.start}); TOML files must be UTF-8") from None
    except RecursionError:
        raise ConfigError(f"config file {where} is not valid TOML: nested too deeply") from None
    legacy_hits: list[Setting] = []
    own_hits: list[Setting] = []
    for key, table in data.items():
        if key not in SECTIONS and key != "legacy":
            hint = _suggest(key, [*SECTIONS, "legacy"])
            if key in LEGACY_BY_NAME:
                hint = f"; legacy names go in the [legacy] table: [legacy] {key} = ..."
            elif len(FLAT.get(key, [])) == 1:
                hint = f"; did you mean [{FLAT[key][0].split('.')[0]}] {key}?"
            raise ConfigError(f"{where}: unknown key {key!r} (allowed: tables [legacy], [{'], ['.join(sorted(SECTIONS))}]){hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {key!r} must be a table [{key}], got {type(table).__name__}")
        for name, value in table.items():
            if key == "legacy":
                if name not in LEGACY_BY_NAME:
                    raise ConfigError(f"{where}: unknown key [legacy] {name}{_suggest(name, LEGACY_BY_NAME)}")
                s = _legacy_setting(name, value, f"{where}: [legacy] {name}")
                if s is not None:
                    legacy_hits.append(s)
                continue
            path = f"{key}.{name}"
            if path not in FIELDS:
                fields = [p.split(".")[1] for p in FIELDS if p.startswith(key + ".")]
                raise ConfigError(f"{where}: unknown key [{key}] {name}{_suggest(name, fields)}")
            own_hits.append(Setting(path, value, f"{where}: [{key}] {name}"))
    # As in the environment, the qnpipe spelling beats the legacy system spelling.
    return _check_legacy_conflicts(legacy_hits) + own_hits


def _override_path(key: str) -> str:
    """Resolve a qnpipe override key (dotted, alias or unique field name) to a dotted path."""
    if "." in key:
        if key in FIELDS:
            return key
        raise ConfigError(f"unknown override {key!r}{_suggest(key, FIELDS)}")
    if key in OVERRIDE_ALIASES:
        return OVERRIDE_ALIASES[key]
    paths = FLAT.get(key, [])
    if len(paths) == 1:
        return paths[0]
    if len(paths) > 1:
        raise ConfigError(f"override {key!r} is ambiguous: use one of {', '.join(paths)}")
    candidates = [*FIELDS, *FLAT, *OVERRIDE_ALIASES]
    raise ConfigError(f"unknown override {key!r}{_suggest(key, candidates)} (allowed: section.field, see docs/config.md)")


def override_path(key: str) -> str:
    """The dotted path an override key names, resolved as ``load`` resolves it (``expert_slots``,
    ``EXPERT_SLOTS`` -> ``pool.expert_slots``); ConfigError naming the key when it is unknown, ambiguous
    or a legacy switch that qnpipe replaces."""
    if key in LEGACY_BY_NAME:
        legacy = LEGACY_BY_NAME[key]
        if legacy.kind is Kind.REPLACED:
            raise ConfigError(f"legacy switch {key} has no effect in qnpipe: replaced by {legacy.target}")
        return legacy.target
    return _override_path(key.replace("-", "_"))


def override_settings(overrides: Mapping[str, object]) -> list[Setting]:
    """The settings of overrides: dotted paths, unique field names, aliases, legacy names, section dicts."""
    legacy_hits: list[Setting] = []
    own_hits: list[Setting] = []
    for raw_key, value in overrides.items():
        if raw_key in LEGACY_BY_NAME:  # upper case, never a qnpipe name
            s = _legacy_setting(raw_key, value, f"override {raw_key}")
            if s is not None:
                legacy_hits.append(s)
            continue
        key = raw_key.replace("-", "_")  # CLI spelling --expert-slots
        if key in SECTIONS and isinstance(value, Mapping):  # mtp={"enabled": True}
            own_hits += [Setting(_override_path(f"{key}.{k}"), v, f"override {key}.{k}") for k, v in value.items()]
        else:
            own_hits.append(Setting(_override_path(key), value, f"override {raw_key}"))
    return _check_legacy_conflicts(legacy_hits) + own_hits
