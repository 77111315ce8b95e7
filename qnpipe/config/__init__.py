"""The configuration: one frozen `Config` tree, loaded from defaults < TOML file < environment.

`qnpipe.config.load()` is the only place in qnpipe that reads the environment or a TOML file
(tests/test_no_env_reads.py); everything else is handed a `Config`. Inside: `tree` (the
sections and their fields, each with its bounds in its type), `fields` (the field specs read from
it), `sources` (the environment, TOML and override readers), `loader` (`load`, `with_overrides`,
`explicit_settings`; it re-exports the names of the two before it), `aliases` and
`layersets` (the previous system's names and layer-set syntax), `pending` (fields declared but
not yet consumed) and `validate` (the checks of a generation's arguments). This package imports
nothing of qnpipe but `qnpipe.errors` and the leaf `qnpipe.files` (tests/test_imports.py), so
every layer may depend on it.
"""

from __future__ import annotations

from qnpipe.config.loader import (
    LEGACY_NAMES,
    NOT_YET_IMPLEMENTED,
    OVERRIDE_ALIASES,
    ChatCfg,
    ComputeCfg,
    Config,
    DiagCfg,
    EvictPolicy,
    FieldSpec,
    ForwardCfg,
    HiddenVariant,
    KvCfg,
    MemoryCfg,
    ModelCfg,
    ModelTier,
    MtpCfg,
    MtpHidden,
    MtpVerifyMode,
    NotImplementedConfigWarning,
    PoolCfg,
    PredictAgg,
    PredictCfg,
    PrefetchInto,
    PrefixCfg,
    ReadBackend,
    ReadCfg,
    ReplacedSwitchWarning,
    TraceCfg,
    check_evict_policy,
    describe_allowed,
    explicit_settings,
    field_specs,
    format_layer_set,
    load,
    override_path,
    parse_layer_set,
    rebuilt,
    with_overrides,
)

# Callers catch what the loader raises without reaching for qnpipe.errors.
from qnpipe.errors import ConfigError

__all__ = [
    "ChatCfg", "ComputeCfg", "Config", "ConfigError", "describe_allowed", "DiagCfg", "EvictPolicy", "explicit_settings",
    "field_specs",
    "check_evict_policy", "FieldSpec", "format_layer_set", "ForwardCfg", "HiddenVariant", "KvCfg", "ModelTier",
    "NOT_YET_IMPLEMENTED", "NotImplementedConfigWarning",
    "load", "MemoryCfg", "ModelCfg", "MtpCfg", "MtpHidden", "MtpVerifyMode", "OVERRIDE_ALIASES",
    "parse_layer_set", "PoolCfg", "PredictAgg", "PredictCfg", "PrefetchInto", "PrefixCfg", "ReadCfg",
    "ReadBackend", "ReplacedSwitchWarning", "LEGACY_NAMES", "TraceCfg", "with_overrides", "override_path", "rebuilt",
]
