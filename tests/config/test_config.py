"""qnpipe.config: precedence, legacy names, parsing, errors, fingerprint, immutability."""

from __future__ import annotations

import enum
import importlib.util
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import config
from qnpipe.config import (
    Config,
    FieldSpec,
    MtpCfg,
    NotImplementedConfigWarning,
    ReplacedSwitchWarning,
    fields,
    format_layer_set,
    load,
    loader,
    parse_layer_set,
    with_overrides,
)
from qnpipe.config.aliases import LEGACY_NAMES, Kind, LegacyName
from qnpipe.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SPECS = {s.path: s for s in config.field_specs()}
# Cross-field rules: these switches only make sense with a companion switch on.
COMPANIONS = {"TREE_TOP2_P1": {"TREE_TOP2": "1"}, "MTP_ADAPTIVE_RESCUE": {"MTP_ADAPTIVE_DEPTH": "1"}}


@pytest.fixture(autouse=True)
def _fresh_warning_registry() -> Iterator[None]:
    # "Once per process" is module state; each test starts as a fresh process would.
    loader._warned_names.clear()
    # These tests set every field on purpose; the warning itself is tested below with pytest.warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotImplementedConfigWarning)
        yield


def _write(tmp_path: Path, text: str, name: str = "qnpipe.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _other_text(spec: FieldSpec) -> str:
    """An environment string that sets ``spec``'s field to a valid non-default value."""
    t, d = spec.type, spec.default
    if isinstance(t, msgspec.inspect.UnionType):  # int | None
        return "5"
    if isinstance(t, msgspec.inspect.BoolType):
        return "0" if d else "1"
    if isinstance(t, msgspec.inspect.EnumType):
        return next(m.value for m in t.cls if m != d)
    if isinstance(t, msgspec.inspect.LiteralType):
        return str(next(v for v in t.values if v != d))
    if isinstance(t, msgspec.inspect.IntType):
        assert isinstance(d, int)
        return str(d + 1)
    if isinstance(t, msgspec.inspect.FloatType):
        assert isinstance(d, float)
        return str(d + 0.25)
    if isinstance(t, msgspec.inspect.StrType) and isinstance(d, enum.Enum):  # pool.evict_policy: enum or plug-in
        return next(m.value for m in type(d) if m != d)
    if isinstance(t, msgspec.inspect.StrType):
        return "some/where"
    if isinstance(t, msgspec.inspect.VarTupleType):
        item = t.item_type.type if isinstance(t.item_type, msgspec.inspect.Metadata) else t.item_type
        return "1-2" if isinstance(item, msgspec.inspect.IntType) else "a,b"
    raise AssertionError(f"no test value for {spec.path}: {t}")


# ------------------------------------------------------------------ defaults and shape


def test_defaults_are_the_legacy_measured_defaults() -> None:
    cfg = load(env={})
    assert cfg == Config()
    assert cfg.pool.expert_slots == 64
    assert cfg.forward.prefill_chunk_tokens == 512  # not the legacy 2 (issue 39, qnpipe.policy.prefill)
    assert cfg.read.nocache is True and cfg.read.workers == 8 and cfg.read.bg_budget_experts == 12
    assert cfg.predict.width_experts == 24 and cfg.predict.aggregate is config.PredictAgg.MAX
    assert cfg.mtp.enabled is False and cfg.mtp.conf_tau == 0.3 and cfg.mtp.depth_max == 3
    assert cfg.kv.k_bits == 4 and cfg.kv.v_bits == 3 and cfg.kv.group_size == 64
    assert cfg.prefix.snapshot_head_tokens == 2048
    assert cfg.chat.tools_allow == ()  # qnpipe differs from the legacy system here on purpose
    assert cfg.diag.route_verify is False and cfg.forward.moe_topk_override is None


def test_frozen() -> None:
    cfg = load(env={})
    with pytest.raises(AttributeError):
        cfg.pool.expert_slots = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.pool = config.PoolCfg()  # type: ignore[misc]


def test_derived_paths() -> None:
    cfg = load(env={}, overrides={"model_dir": Path("/m")})
    assert cfg.model.model_dir == "/m"
    assert cfg.model.resolved_config_path() == "/m/config.json"
    assert cfg.model.resolved_expert_dir() == "/m/experts"
    assert cfg.autopin_usage_path() == "/m/experts/pool_usage.json"
    assert with_overrides(cfg, autopin_usage_file="/h.json").autopin_usage_path() == "/h.json"


# ------------------------------------------------------------------ precedence


def test_precedence_each_level_beats_the_previous(tmp_path: Path) -> None:
    toml = _write(tmp_path, "[pool]\nexpert_slots = 40\n")
    assert load(env={}).pool.expert_slots == 64
    assert load(toml, env={}).pool.expert_slots == 40
    assert load(toml, env={"EXPERT_SLOTS": "30"}).pool.expert_slots == 30
    both = {"EXPERT_SLOTS": "30", "QNPIPE_POOL__EXPERT_SLOTS": "20"}
    assert load(toml, env=both).pool.expert_slots == 20  # QNPIPE_ beats the bare legacy name
    assert load(toml, env=both, overrides={"expert_slots": 10}).pool.expert_slots == 10


def test_toml_section_beats_legacy_table(tmp_path: Path) -> None:
    toml = _write(tmp_path, "[legacy]\nEXPERT_SLOTS = 8\nKV_QUANT = 1\n[pool]\nexpert_slots = 9\n")
    cfg = load(toml, env={})
    assert cfg.pool.expert_slots == 9 and cfg.kv.quantize is True


def test_qnpipe_config_env_names_the_toml_file(tmp_path: Path) -> None:
    toml = _write(tmp_path, "[mtp]\nenabled = true\n")
    assert load(env={"QNPIPE_CONFIG": str(toml)}).mtp.enabled is True


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QNPIPE_POOL__EXPERT_SLOTS", "7")
    assert load().pool.expert_slots == 7


def test_unrelated_env_vars_are_ignored() -> None:
    assert load(env={"PATH": "/bin", "HOME": "/h", "QNPIPEX": "1", "EXPERT": "x"}) == Config()


def test_docs_toml_example_loads(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "config.md").read_text()
    example = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert example is not None
    cfg = load(_write(tmp_path, example[1]), env={})
    assert cfg.pool.expert_slots == 32 and cfg.mtp.adaptive_depth and cfg.kv.quantize
    assert cfg.trace.route_trace_layers == (0, 1, 2, 3, 47)


# ------------------------------------------------------------------ legacy names


def test_legacy_table_is_consistent() -> None:
    names = [s.name for s in LEGACY_NAMES]
    assert len(names) == len(set(names)) == 116  # every switch of the legacy system's config module
    for s in LEGACY_NAMES:
        if s.kind is not Kind.REPLACED:
            assert s.target in SPECS, s


@pytest.mark.parametrize("legacy", [s for s in LEGACY_NAMES if s.kind is not Kind.REPLACED], ids=lambda s: s.name)
def test_feature_legacy_name_sets_its_field(legacy: LegacyName) -> None:
    spec = SPECS[legacy.target]
    env = {legacy.name: _other_text(spec), **COMPANIONS.get(legacy.name, {})}
    cfg = load(env=env)
    section, field = legacy.target.split(".")
    assert getattr(getattr(cfg, section), field) != spec.default
    assert cfg.fingerprint() != Config().fingerprint()
    # The QNPIPE_ spelling of the same field gives the same config.
    same = load(env={spec.env_name: env.pop(legacy.name), **env})
    assert same == cfg


@pytest.mark.parametrize("legacy", [s for s in LEGACY_NAMES if s.kind is Kind.REPLACED], ids=lambda s: s.name)
def test_replaced_legacy_name_warns_once_and_changes_nothing(legacy: LegacyName) -> None:
    with pytest.warns(ReplacedSwitchWarning, match=legacy.name) as record:
        assert load(env={legacy.name: "1"}) == Config()
    assert len(record) == 1
    assert legacy.target in str(record[0].message)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert load(env={legacy.name: "0"}) == Config()
    assert not [w for w in again if issubclass(w.category, ReplacedSwitchWarning)]


def test_replaced_legacy_name_in_toml_and_overrides(tmp_path: Path) -> None:
    with pytest.warns(ReplacedSwitchWarning, match="NATIVE_MOE"):
        assert load(_write(tmp_path, "[legacy]\nNATIVE_MOE = 1\n"), env={}) == Config()
    with pytest.warns(ReplacedSwitchWarning, match="GPU_REMAP"):
        assert load(env={}, overrides={"GPU_REMAP": 0}) == Config()


def test_a_field_without_its_feature_warns_once_naming_both() -> None:
    with pytest.warns(NotImplementedConfigWarning) as record:
        assert load(env={"WINDOW_PROF": "1"}).diag.window_prof is True
    assert [str(w.message) for w in record] == [
        "diag.window_prof=True has no effect yet: the diagnostic probes (recorder's event log) "
        "is not implemented (docs/config.md)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(env={"WINDOW_PROF": "1"})  # once per process
        loader._warned_names.clear()
        load(env={"WINDOW_PROF": "0"})  # the default: nothing to warn about
        load(overrides={"pool.expert_slots": 8})  # a field with a consumer
    with pytest.warns(NotImplementedConfigWarning, match=r"model\.config_path='c\.json' .*loader") as record:
        with_overrides(Config(), {"model.config_path": "c.json"})
    assert record[0].filename == __file__  # the caller's line, not qnpipe's


def test_the_side_region_is_always_read_in_place_and_the_legacy_copy_mode_warns() -> None:
    assert Config().pool.side_region_zerocopy is True
    assert load(overrides={"pool.side_region_slots": 0}).pool.side_region_slots == 0  # no side region: fine
    with pytest.warns(NotImplementedConfigWarning, match=r"side_region_zerocopy=False has no effect.*in place") as record:
        assert load(env={"ZEROCOPY_DUAL_SOURCE": "0"}).pool.side_region_zerocopy is False
    assert len(record) == 1


def test_two_legacy_names_for_one_field_must_agree() -> None:
    assert load(env={"EXPERT_NOCACHE": "0", "STREAM_BLOB_NOCACHE": "false"}).read.nocache is False
    with pytest.raises(ConfigError, match="EXPERT_NOCACHE.*STREAM_BLOB_NOCACHE"):
        load(env={"EXPERT_NOCACHE": "1", "STREAM_BLOB_NOCACHE": "0"})


def test_tools_allow_is_a_comma_list() -> None:
    assert load(env={"TOOLS_ALLOW": " a, b,,a "}).chat.tools_allow == ("a", "b")
    assert load(env={"TOOLS_ALLOW": ""}).chat.tools_allow == ()


# ------------------------------------------------------------------ value parsing and errors


@pytest.mark.parametrize(
    ("text", "expected"), [("0", False), ("1", True), ("true", True), ("false", False), ("TRUE", True), ("False", False)]
)
def test_bool_parsing(text: str, expected: bool) -> None:
    assert load(env={"KV_QUANT": text}).kv.quantize is expected
    assert load(env={"QNPIPE_DIAG__ROUTE_VERIFY": text}).diag.route_verify is expected


@pytest.mark.parametrize("text", ["yes", "2", "", "on"])
def test_bad_bool_names_key_value_and_allowed(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(env={"KV_QUANT": text})
    msg = str(info.value)
    assert "kv.quantize" in msg and "KV_QUANT" in msg and repr(text) in msg and "true or false" in msg


@pytest.mark.parametrize(
    ("name", "path", "allowed"),
    [
        ("EVICT_POLICY", "pool.evict_policy", "lfu, lru, fifo"),
        ("PREDICT_AGG", "predict.aggregate", "max, mean, union"),
        ("MTP_VERIFY_MODE", "mtp.verify_mode", "batch, sequential"),
        ("HIDDEN_VARIANT", "model.hidden_variant", "pre_final_norm, post_final_norm"),
        ("MTP_HIDDEN", "mtp.hidden", "pre_norm, post_norm"),
        ("MTP_BITS", "mtp.bits", "2, 3, 4, 5, 6, 8"),
    ],
)
def test_bad_enum_names_allowed_values(name: str, path: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(env={name: "7oops" if name != "MTP_BITS" else "7"})
    msg = str(info.value)
    assert path in msg and name in msg and allowed in msg


def test_enum_values_accepted() -> None:
    cfg = load(env={"EVICT_POLICY": "lru", "QNPIPE_PREDICT__AGGREGATE": "union"}, overrides={"mtp.hidden": "post_norm"})
    assert cfg.pool.evict_policy is config.EvictPolicy.LRU
    assert cfg.predict.aggregate is config.PredictAgg.UNION
    assert cfg.mtp.hidden is config.MtpHidden.POST_NORM


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"EXPERT_SLOTS": "x"}, ["pool.expert_slots", "EXPERT_SLOTS", "'x'", "an integer >= 1"]),
        ({"QNPIPE_POOL__EXPERT_SLOTS": "0"}, ["pool.expert_slots", "QNPIPE_POOL__EXPERT_SLOTS", ">= 1"]),
        ({"AUTOPIN_BUDGET_FRAC": "1.5"}, ["pool.autopin_budget_frac", "<= 1.0"]),
        ({"KV_GROUP_SIZE": "0"}, ["kv.group_size", ">= 1"]),
        ({"KV_K_BITS": "9"}, ["kv.k_bits", "<= 8"]),
        ({"MTP_CONF_TAU": "nan"}, ["mtp.conf_tau"]),
        ({"PREFILL_CHUNK": "-1"}, ["forward.prefill_chunk_tokens", ">= 0"]),
    ],
)
def test_bad_values_name_key_and_allowed(env: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load(env=env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match=r"tree_top2_p1.*TREE_TOP2_P1|TREE_TOP2_P1.*tree_top2"):
        load(env={"TREE_TOP2_P1": "1"})
    with pytest.raises(ConfigError, match="exclusive"):
        load(env={}, overrides={"adaptive_depth": True, "tree_top2": True})
    with pytest.raises(ConfigError, match="adaptive_depth"):
        MtpCfg(adaptive_rescue=True)  # the rule holds for direct construction too
    assert load(env={"MTP_ADAPTIVE_DEPTH": "1", "MTP_ADAPTIVE_RESCUE": "1"}).mtp.adaptive_rescue


def test_unknown_qnpipe_env_fails_with_suggestion() -> None:
    with pytest.raises(ConfigError, match="QNPIPE_POOL__EXPERT_SLOT.*did you mean QNPIPE_POOL__EXPERT_SLOTS"):
        load(env={"QNPIPE_POOL__EXPERT_SLOT": "3"})
    with pytest.raises(ConfigError, match="did you mean QNPIPE_POOL__EXPERT_SLOTS"):
        load(env={"QNPIPE_EXPERT_SLOTS": "3"})
    with pytest.raises(ConfigError, match="QNPIPE_FOO__BAR"):
        load(env={"QNPIPE_FOO__BAR": "1"})


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[pool]\nexpert_slot = 3\n", ["[pool] expert_slot", "did you mean expert_slots"]),
        ("[pol]\nexpert_slots = 3\n", ["'pol'", "did you mean pool"]),
        ("EXPERT_SLOTS = 3\n", ["'EXPERT_SLOTS'", "[legacy]"]),
        ("expert_slots = 3\n", ["'expert_slots'", "[pool] expert_slots"]),
        ("[legacy]\nEXPERT_SLOT = 3\n", ["[legacy] EXPERT_SLOT", "did you mean EXPERT_SLOTS"]),
        ("[pool]\nevict_policy = 'mru'\n", ["[pool] evict_policy", "'mru'", "lfu, lru, fifo"]),
        ("[pool\n", ["not valid TOML"]),
    ],
)
def test_bad_toml_names_file_and_key(tmp_path: Path, text: str, fragments: list[str]) -> None:
    toml = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(toml, env={})
    msg = str(info.value)
    assert str(toml) in msg
    for fragment in fragments:
        assert fragment in msg


def test_missing_toml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "absent.toml", env={})


# ------------------------------------------------------------------ overrides


def test_override_spellings() -> None:
    cfg = load(env={}, overrides={"pool.side_region_slots": 8, "expert_slots": 32, "mtp": True, "prefill-chunk": 0})
    assert (cfg.pool.side_region_slots, cfg.pool.expert_slots, cfg.mtp.enabled) == (8, 32, True)
    assert cfg.forward.prefill_chunk_tokens == 0
    cfg = load(env={}, overrides={"mtp": {"enabled": True, "bits": 8}, "EXPERT_SLOTS": "16", "route_verify": True})
    assert (cfg.mtp.enabled, cfg.mtp.bits, cfg.pool.expert_slots, cfg.diag.route_verify) == (True, 8, 16, True)


def test_unknown_and_ambiguous_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="'expert_slot'.*did you mean expert_slots"):
        load(env={}, overrides={"expert_slot": 3})
    with pytest.raises(ConfigError, match="'pool.expert_slot'.*did you mean pool.expert_slots"):
        load(env={}, overrides={"pool.expert_slot": 3})
    monkeypatch.setitem(fields.FLAT, "expert_slots", ["pool.expert_slots", "read.workers"])
    with pytest.raises(ConfigError, match="ambiguous.*pool.expert_slots, read.workers"):
        load(env={}, overrides={"expert_slots": 3})


def test_with_overrides() -> None:
    base = load(env={"EXPERT_SLOTS": "48"})
    new = with_overrides(base, {"mtp": True}, expert_slots=32)
    assert (new.pool.expert_slots, new.mtp.enabled) == (32, True)
    assert base.pool.expert_slots == 48 and base.mtp.enabled is False  # untouched
    assert with_overrides(base, {"kv.quantize": True, "route_trace_layers": "3,1-2"}).trace.route_trace_layers == (1, 2, 3)
    assert with_overrides(base).fingerprint() == base.fingerprint()
    with pytest.raises(ConfigError, match="pool.expert_slots.*override expert_slots"):
        with_overrides(base, expert_slots=0)


# ------------------------------------------------------------------ layer sets


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", ()), ("  ", ()), ("5", (5,)), ("0-3,5,8", (0, 1, 2, 3, 5, 8)), ("8, 0 - 1,1,", (0, 1, 8)), ("2-2", (2,))],
)
def test_parse_layer_set(text: str, expected: tuple[int, ...]) -> None:
    assert parse_layer_set(text) == expected


@pytest.mark.parametrize(("text", "why"), [("3-1", "backwards"), ("a", "layer number"), ("-1", "non-negative"),
                                           ("1-", "layer number"), ("0-9999999", "maximum"), ("1.5", "layer number")])
def test_parse_layer_set_errors(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        parse_layer_set(text)
    assert repr(text) in str(info.value)


@given(st.sets(st.integers(min_value=0, max_value=200), max_size=40))
def test_layer_set_round_trip(layers: set[int]) -> None:
    text = format_layer_set(layers)
    assert parse_layer_set(text) == tuple(sorted(layers))
    assert parse_layer_set(text.replace(",", " , ")) == tuple(sorted(layers))


def test_layer_set_field_from_env_toml_and_override(tmp_path: Path) -> None:
    assert load(env={"QNPIPE_TRACE__ROUTE_TRACE_LAYERS": "5,0-2"}).trace.route_trace_layers == (0, 1, 2, 5)
    toml = _write(tmp_path, "[trace]\nroute_trace_layers = [7, 3, 3]\n")
    assert load(toml, env={}).trace.route_trace_layers == (3, 7)
    with pytest.raises(ConfigError, match="trace.route_trace_layers.*backwards"):
        load(env={}, overrides={"route_trace_layers": "3-1"})


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_changes_with_any_field() -> None:
    base = Config()
    # Fields whose cross-field rules need a companion switch on (see COMPANIONS).
    companions = {"mtp.tree_top2_p1": {"mtp.tree_top2": True}, "mtp.adaptive_rescue": {"mtp.adaptive_depth": True}}
    seen = {base.fingerprint()}
    for spec in config.field_specs():
        seen.add(with_overrides(base, {spec.path: _other_text(spec), **companions.get(spec.path, {})}).fingerprint())
    # Every single-field change gives its own fingerprint.
    assert len(seen) == len(SPECS) + 1
    assert re.fullmatch(r"[0-9a-f]{64}", base.fingerprint())


def test_fingerprint_stable_across_processes() -> None:
    overrides = {"expert_slots": 32, "mtp": True, "tools_allow": "b,a", "route_trace_layers": "0-2"}
    code = (
        "from qnpipe.config import load\n"
        f"print(load(env={{}}, overrides={overrides!r}).fingerprint())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == load(env={}, overrides=overrides).fingerprint()


# ------------------------------------------------------------------ docs


def _config_table_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_table", REPO / "tools" / "config_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_tables_are_generated_from_the_code() -> None:
    tool = _config_table_tool()
    doc = (REPO / "docs" / "config.md").read_text()
    assert tool.splice(doc, tool.render()) == doc, "run: python tools/config_table.py --write docs/config.md"
    for legacy in LEGACY_NAMES:
        assert f"`{legacy.name}`" in doc
    for path in SPECS:
        assert f"`{path}`" in doc


def test_every_enum_value_documented() -> None:
    for spec in config.field_specs():
        if isinstance(spec.type, msgspec.inspect.EnumType):
            assert issubclass(spec.type.cls, enum.StrEnum)
            allowed = config.describe_allowed(spec.type)
            assert all(m.value in allowed for m in spec.type.cls)
