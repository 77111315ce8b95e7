"""qnpipe's single typed configuration: the frozen ``Config`` tree and ``load()``.

This is the only module of qnpipe that reads the environment or a TOML config file.
``load`` runs once, at start-up; the resulting ``Config`` is immutable and each actor
receives only its own sub-struct, so nothing is read per token.

Precedence, lowest first: field defaults < TOML file < environment < overrides.
Environment names: ``QNPIPE_<SECTION>__<FIELD>`` and every bare switch name of the
previous system (``EXPERT_SLOTS``, ``PREFILL_CHUNK``, ... see ``qnpipe.config.aliases``); when
both spellings set one field, the ``QNPIPE_`` one wins. ``docs/config.md`` has the
full story and the generated reference tables.
"""

from __future__ import annotations

import difflib
import enum
import os
import re
import sys
import tomllib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from qnpipe.config.aliases import LEGACY_BY_NAME, LEGACY_NAMES, Kind, LegacyName
from qnpipe.config.layersets import format_layer_set, parse_layer_set
from qnpipe.config.pending import NOT_YET_IMPLEMENTED
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
from qnpipe.files import CONFIG_CAP, read_capped

__all__ = [
    "ChatCfg", "ComputeCfg", "Config", "describe_allowed", "DiagCfg", "EvictPolicy", "explicit_settings",
    "field_specs", "check_evict_policy", "FieldSpec", "format_layer_set", "ForwardCfg", "HiddenVariant", "KvCfg",
    "NOT_YET_IMPLEMENTED", "NotImplementedConfigWarning",
    "load", "MemoryCfg", "ModelCfg", "MtpCfg", "MtpHidden", "MtpVerifyMode", "OVERRIDE_ALIASES",
    "parse_layer_set", "PoolCfg", "PredictAgg", "PredictCfg", "PrefetchInto", "PrefixCfg", "ReadCfg",
    "ReadBackend", "ReplacedSwitchWarning", "LEGACY_NAMES", "TraceCfg", "with_overrides",
    "override_path",
]

ENV_PREFIX = "QNPIPE_"
# Names the TOML file when load() gets no toml_path; not a Config field.
ENV_CONFIG_FILE = "QNPIPE_CONFIG"
_NOT_FIELDS = frozenset({ENV_CONFIG_FILE})


class ReplacedSwitchWarning(UserWarning):
    """A switch of the previous system was set that qnpipe's architecture replaces (no effect)."""


class NotImplementedConfigWarning(UserWarning):
    """A field was set whose feature does not exist yet (``qnpipe.config.pending``): it has no effect."""


# --------------------------------------------------------------------------- field table


class FieldSpec(NamedTuple):
    """One leaf field of ``Config``: dotted path, msgspec type info, default, description."""

    path: str
    type: msgspec.inspect.Type
    default: object
    doc: str
    allowed: str  # what the field accepts, in words (describe_allowed, or the field's own Meta(extra={"allowed"}))

    @property
    def env_name(self) -> str:
        """The ``QNPIPE_<SECTION>__<FIELD>`` environment name of this field."""
        section, field = self.path.split(".")
        return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"


def _unwrap(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, str]:
    doc = ""
    while isinstance(t, msgspec.inspect.Metadata):
        doc = (t.extra_json_schema or {}).get("description", doc)
        t = t.type
    return t, doc


def describe_allowed(t: msgspec.inspect.Type) -> str:
    """A short English description of the values a field of type ``t`` accepts."""
    t, _ = _unwrap(t)
    if isinstance(t, msgspec.inspect.BoolType):
        return "true or false (1 or 0)"
    if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        noun = "an integer" if isinstance(t, msgspec.inspect.IntType) else "a number"
        bounds = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return f"{noun} {' and '.join(bounds)}".strip()
    if isinstance(t, msgspec.inspect.EnumType):
        return "one of " + ", ".join(str(m.value) for m in t.cls)
    if isinstance(t, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, msgspec.inspect.StrType):
        return "a string"
    if isinstance(t, msgspec.inspect.UnionType):
        parts = ["empty (none)" if isinstance(a, msgspec.inspect.NoneType) else describe_allowed(a) for a in t.types]
        return ", or ".join(parts)
    if isinstance(t, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        item, _ = _unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            return "a layer set such as 0-3,5,8 (empty = all layers)"
        return "a comma-separated list (empty = none)"
    return type(t).__name__


def _build_fields() -> dict[str, FieldSpec]:
    out: dict[str, FieldSpec] = {}
    root = msgspec.inspect.type_info(Config)
    assert isinstance(root, msgspec.inspect.StructType)
    for sf in root.fields:
        section_t, _ = _unwrap(sf.type)
        assert isinstance(section_t, msgspec.inspect.StructType)
        for f in section_t.fields:
            t, doc = _unwrap(f.type)
            default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            # A field whose type does not say it all (pool.evict_policy, a str) says it in its Meta.
            allowed = f.type.extra.get("allowed") if isinstance(f.type, msgspec.inspect.Metadata) and f.type.extra else None
            out[f"{sf.name}.{f.name}"] = FieldSpec(f"{sf.name}.{f.name}", t, default, doc,
                                                   str(allowed) if allowed else describe_allowed(t))
    return out


_FIELDS: dict[str, FieldSpec] = _build_fields()
_SECTIONS: frozenset[str] = frozenset(p.split(".")[0] for p in _FIELDS)
# Field name -> dotted paths; a name with one path works as a flat override key.
_FLAT: dict[str, list[str]] = {}
for _path in _FIELDS:
    _FLAT.setdefault(_path.split(".")[1], []).append(_path)
del _path

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


def field_specs() -> tuple[FieldSpec, ...]:
    """Every leaf field of ``Config`` in declaration order (used to generate docs/config.md)."""
    return tuple(_FIELDS.values())


# --------------------------------------------------------------------------- loading


class _Setting(NamedTuple):
    path: str  # qnpipe dotted path
    value: object
    source: str  # where it came from, for error messages


_warned_names: set[str] = set()


def _stacklevel() -> int:
    # Point warnings at the first frame outside qnpipe: the user's Engine(...) or load() call.
    level, frame = 1, sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__")).partition(".")[0] == "qnpipe":
        level, frame = level + 1, frame.f_back
    return level


def _warn_replaced(legacy: LegacyName, source: str) -> None:
    if legacy.name in _warned_names:
        return
    _warned_names.add(legacy.name)
    warnings.warn(
        f"legacy switch {legacy.name} ({source}) has no effect in qnpipe: it meant {legacy.meaning!r}; "
        f"replaced by {legacy.target}",
        ReplacedSwitchWarning,
        stacklevel=_stacklevel(),
    )


def _suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _legacy_setting(name: str, value: object, source: str) -> _Setting | None:
    legacy = LEGACY_BY_NAME[name]
    if legacy.kind is Kind.REPLACED:
        _warn_replaced(legacy, source)
        return None
    return _Setting(legacy.target, value, source)


def _same_value(a: object, b: object) -> bool:
    def norm(v: object) -> object:
        s = str(v).strip().lower()
        return {"1": "true", "0": "false"}.get(s, s)

    return norm(a) == norm(b)


def _check_legacy_conflicts(settings: list[_Setting]) -> list[_Setting]:
    # Two legacy names for one field (EXPERT_NOCACHE, STREAM_BLOB_NOCACHE) must agree.
    seen: dict[str, _Setting] = {}
    for s in settings:
        prev = seen.get(s.path)
        if prev is not None and not _same_value(prev.value, s.value):
            raise ConfigError(
                f"{s.path} is set twice with different values: {prev.source}={prev.value!r} "
                f"and {s.source}={s.value!r}; set one of them"
            )
        seen[s.path] = s
    return settings


def _env_settings(env: Mapping[str, str]) -> list[_Setting]:
    legacy_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            if key in _NOT_FIELDS:
                continue
            section, _, field = key[len(ENV_PREFIX):].partition("__")
            path = f"{section.lower()}.{field.lower()}"
            if path not in _FIELDS:
                # Compare without the shared prefix, which would make every name look close.
                flat = _FLAT.get(key[len(ENV_PREFIX):].lower(), [])
                close = _suggest(key[len(ENV_PREFIX):], [s.env_name[len(ENV_PREFIX):] for s in _FIELDS.values()])
                hint = f"; did you mean {_FIELDS[flat[0]].env_name}?" if len(flat) == 1 else close.replace(
                    "mean ", "mean " + ENV_PREFIX)
                what = f"no qnpipe field {path}" if field else f"not of the form {ENV_PREFIX}<SECTION>__<FIELD>"
                raise ConfigError(f"unknown environment variable {key}={raw!r}: {what}{hint} (see docs/config.md)")
            own_hits.append(_Setting(path, raw, f"environment variable {key}"))
        elif key in LEGACY_BY_NAME:
            s = _legacy_setting(key, raw, f"environment variable {key}")
            if s is not None:
                legacy_hits.append(s)
    # The QNPIPE_ spelling comes last so it wins over the bare legacy name.
    return _check_legacy_conflicts(legacy_hits) + own_hits


def _toml_settings(toml_path: str | os.PathLike[str]) -> list[_Setting]:
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
    legacy_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for key, table in data.items():
        if key not in _SECTIONS and key != "legacy":
            hint = _suggest(key, [*_SECTIONS, "legacy"])
            if key in LEGACY_BY_NAME:
                hint = f"; legacy names go in the [legacy] table: [legacy] {key} = ..."
            elif len(_FLAT.get(key, [])) == 1:
                hint = f"; did you mean [{_FLAT[key][0].split('.')[0]}] {key}?"
            raise ConfigError(f"{where}: unknown key {key!r} (allowed: tables [legacy], [{'], ['.join(sorted(_SECTIONS))}]){hint}")
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
            if path not in _FIELDS:
                fields = [p.split(".")[1] for p in _FIELDS if p.startswith(key + ".")]
                raise ConfigError(f"{where}: unknown key [{key}] {name}{_suggest(name, fields)}")
            own_hits.append(_Setting(path, value, f"{where}: [{key}] {name}"))
    # As in the environment, the qnpipe spelling beats the legacy system spelling.
    return _check_legacy_conflicts(legacy_hits) + own_hits


def _override_path(key: str) -> str:
    """Resolve a qnpipe override key (dotted, alias or unique field name) to a dotted path."""
    if "." in key:
        if key in _FIELDS:
            return key
        raise ConfigError(f"unknown override {key!r}{_suggest(key, _FIELDS)}")
    if key in OVERRIDE_ALIASES:
        return OVERRIDE_ALIASES[key]
    paths = _FLAT.get(key, [])
    if len(paths) == 1:
        return paths[0]
    if len(paths) > 1:
        raise ConfigError(f"override {key!r} is ambiguous: use one of {', '.join(paths)}")
    candidates = [*_FIELDS, *_FLAT, *OVERRIDE_ALIASES]
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


def _override_settings(overrides: Mapping[str, object]) -> list[_Setting]:
    legacy_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for raw_key, value in overrides.items():
        if raw_key in LEGACY_BY_NAME:  # upper case, never a qnpipe name
            s = _legacy_setting(raw_key, value, f"override {raw_key}")
            if s is not None:
                legacy_hits.append(s)
            continue
        key = raw_key.replace("-", "_")  # CLI spelling --expert-slots
        if key in _SECTIONS and isinstance(value, Mapping):  # mtp={"enabled": True}
            own_hits += [_Setting(_override_path(f"{key}.{k}"), v, f"override {key}.{k}") for k, v in value.items()]
        else:
            own_hits.append(_Setting(_override_path(key), value, f"override {raw_key}"))
    return _check_legacy_conflicts(legacy_hits) + own_hits


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
        item, _ = _unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            try:
                return parse_layer_set(value)
            except ConfigError as exc:
                raise ConfigError(f"bad value for {spec.path} (from {source}={value!r}): {exc}") from None
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return value


# Upper bounds of the count settings that size something (threads, slots, arrays, loops): far
# above any use (the 80B has 512 experts a layer, a draft is a few tokens), far below what would
# exhaust memory or threads, so `read.workers=10**9` is an error naming the key at start-up, not a
# crash while the engine builds. Counts that size nothing (periods, seeds, token thresholds) have none.
COUNT_BOUNDS: dict[str, int] = {
    "read.workers": 1024,  # reader threads; the C reader's pool takes at most 1024
    "read.window_layers": 4096,
    "read.bg_budget_experts": 1 << 20,
    "read.prefetch_budget_experts": 1 << 20,
    "pool.expert_slots": 1 << 16,  # clamped to the model's experts per layer anyway
    "pool.side_region_slots": 1024,  # allocated per layer beside the slots; more than a layer has experts is no use
    "predict.ahead_layers": 4096,
    "predict.candidate_mult": 4096,
    "predict.width_experts": 1 << 16,
    "predict.cutoff_layer": 4096,
    "predict.ahead_lo_layers": 4096,
    "predict.ahead_hi_layers": 4096,
    "predict.union_k": 1 << 16,
    "predict.file_global_budget_experts": 1 << 20,
    "predict.stage_global_budget_experts": 1 << 20,
    "predict.per_layer_budget_experts": 1 << 16,
    "prefix.max_entries": 4096,  # states of tens of MB each
    "mtp.num_draft_tokens": 64,  # one MTP forward and one verify row per draft
    "mtp.depth_max": 64,
    "mtp.tree_branches": 64,
    "forward.moe_topk_override": 1 << 16,
    "kv.group_size": 1 << 16,
    "diag.accept_topk": 1 << 20,
}


def _check_bound(path: str, value: object, source: str, given: object) -> None:
    bound = COUNT_BOUNDS.get(path)
    if bound is not None and type(value) is int and value > bound:
        raise ConfigError(f"bad value for {path} (from {source}={given!r}): {value} is more than {bound}; "
                          f"allowed: {_FIELDS[path].allowed}, at most {bound}")


def _apply(tree: dict[str, Any], sources: dict[str, str], settings: Iterable[_Setting]) -> None:
    for s in settings:
        section, field = s.path.split(".")
        value = _coerce(_FIELDS[s.path], s.value, s.source)
        if isinstance(value, str) and s.path in COUNT_BOUNDS and value.strip().lstrip("+-").isdigit():
            _check_bound(s.path, int(value), s.source, s.value)  # text from the environment or --set
        _check_bound(s.path, value, s.source, s.value)
        tree.setdefault(section, {})[field] = value
        sources[s.path] = f"{s.source}={s.value!r}"


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<where>[^`]*)`)?$", re.S)


def _translate(exc: msgspec.ValidationError, sources: Mapping[str, str]) -> ConfigError:
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any text
    what = m["what"]
    path = re.sub(r"\[\d+\]", "", (m["where"] or "").lstrip("."))
    if path in _FIELDS:
        origin = f" (from {sources[path]})" if path in sources else ""
        allowed = _FIELDS[path].allowed
        return ConfigError(f"bad value for {path}{origin}: {what}; allowed: {allowed}")
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
        raise _translate(exc, sources) from exc
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
        _apply(tree, sources, _toml_settings(toml_path))
    _apply(tree, sources, _env_settings(env))
    _apply(tree, sources, _override_settings(overrides or {}))
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
    _apply(tree, sources, _override_settings(merged))
    return _finish(tree, sources)
