"""Each field's bounds are in its type: msgspec enforces them, and the error names the key, the source and the value."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from qnpipe import config
from qnpipe.config import Config, ConfigError, NotImplementedConfigWarning, fields, load, loader, with_overrides

# The caps as the loader held them in a table of its own before they moved into the types: none lost, none changed.
CAPS_BEFORE_THE_SPLIT = {
    "read.workers": 1024, "read.window_layers": 4096, "read.bg_budget_experts": 1 << 20,
    "read.prefetch_budget_experts": 1 << 20, "pool.expert_slots": 1 << 16, "pool.side_region_slots": 1024,
    "predict.ahead_layers": 4096, "predict.candidate_mult": 4096, "predict.width_experts": 1 << 16,
    "predict.cutoff_layer": 4096, "predict.ahead_lo_layers": 4096, "predict.ahead_hi_layers": 4096,
    "predict.union_k": 1 << 16, "predict.file_global_budget_experts": 1 << 20,
    "predict.stage_global_budget_experts": 1 << 20, "predict.per_layer_budget_experts": 1 << 16,
    "prefix.max_entries": 4096, "mtp.num_draft_tokens": 64, "mtp.depth_max": 64, "mtp.tree_branches": 64,
    "forward.moe_topk_override": 1 << 16, "kv.group_size": 1 << 16, "diag.accept_topk": 1 << 20,
}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    loader._warned_names.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotImplementedConfigWarning)
        yield


def test_the_caps_are_the_types_and_the_same_as_before() -> None:
    assert dict(loader.COUNT_BOUNDS) == CAPS_BEFORE_THE_SPLIT
    assert fields.COUNT_BOUNDS is loader.COUNT_BOUNDS


@pytest.mark.parametrize("path", sorted(CAPS_BEFORE_THE_SPLIT))
def test_msgspec_itself_refuses_a_count_above_its_cap(path: str) -> None:
    """No check beside the type: converting a plain tree to Config refuses the value."""
    section, field = path.split(".")
    cap = CAPS_BEFORE_THE_SPLIT[path]
    assert getattr(getattr(msgspec.convert({section: {field: cap}}, Config), section), field) == cap
    with pytest.raises(msgspec.ValidationError, match=f"<= {cap} - at `\\$.{path}`"):
        msgspec.convert({section: {field: cap + 1}}, Config)


@pytest.mark.parametrize("path", sorted(CAPS_BEFORE_THE_SPLIT))
def test_a_count_above_its_cap_is_named_from_every_level(path: str, tmp_path: Path) -> None:
    section, field = path.split(".")
    cap = CAPS_BEFORE_THE_SPLIT[path]
    spec = fields.FIELDS[path]
    toml = tmp_path / "run.toml"
    toml.write_text(f"[{section}]\n{field} = {cap + 1}\n")
    env_name = spec.env_name
    cases = {
        f"environment variable {env_name}={str(cap + 1)!r}": lambda: load(env={env_name: str(cap + 1)}),
        f"{toml}: [{section}] {field}={cap + 1}": lambda: load(toml, env={}),
        f"override {path}={cap + 1}": lambda: load(env={}, overrides={path: cap + 1}),
        f"override {path}={str(cap + 1)!r}": lambda: with_overrides(Config(), {path: str(cap + 1)}),
    }
    for source, call in cases.items():
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == (f"bad value for {path} (from {source}): {cap + 1} is more than {cap}; "
                                   f"allowed: {spec.allowed}")
        assert spec.allowed.endswith(f"at most {cap}") or f"at most {cap}, or empty" in spec.allowed
    # The cap itself is allowed.
    assert getattr(getattr(load(env={}, overrides={path: cap}), section), field) == cap


def test_a_capped_value_overridden_by_a_later_level_is_not_an_error(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[read]\nworkers = 1000000000\n")
    assert load(toml, env={"QNPIPE_READ__WORKERS": "16"}).read.workers == 16


def test_a_range_is_not_a_cap() -> None:
    """kv.k_bits' <= 8 is a range of the format, not a cap: msgspec's own words stay."""
    assert "kv.k_bits" not in loader.COUNT_BOUNDS
    with pytest.raises(ConfigError, match=r"kv\.k_bits .*Expected `int` <= 8; allowed: an integer >= 2 and <= 8$"):
        load(env={"KV_K_BITS": "9"})


def test_other_errors_of_a_capped_field_keep_msgspecs_words() -> None:
    for value, what in ((2000.5, "Expected `int`, got `float`"), ("+2000", "Expected `int`, got `str`"),
                        (0, "Expected `int` >= 1")):
        with pytest.raises(ConfigError) as info:
            load(env={}, overrides={"read.workers": value})
        assert f": {what}; allowed: an integer >= 1, at most 1024" in str(info.value)


def test_the_hidden_variant_warning_does_not_say_mtp_is_missing() -> None:
    """MTP is implemented; what model.hidden_variant lacks is its own consumer (MTP's drafter reads mtp.hidden)."""
    with pytest.warns(NotImplementedConfigWarning) as record:
        load(env={}, overrides={"model.hidden_variant": "post_final_norm"})
    (msg,) = [str(w.message) for w in record]
    assert msg.startswith("model.hidden_variant=") and "has no effect yet: " in msg and "mtp.hidden" in msg
    assert not any("MTP self-speculative decoding" in f for f in config.NOT_YET_IMPLEMENTED.values())


def test_the_loaders_names_stay_importable_from_it() -> None:
    """The split moved code into fields and sources; qnpipe.config.loader still answers for every public name."""
    for name in (*loader.__all__, "COUNT_BOUNDS", "ENV_PREFIX", "ENV_CONFIG_FILE"):
        assert hasattr(loader, name), name
        if name in config.__all__:
            assert getattr(config, name) is getattr(loader, name), name
    assert loader.FieldSpec is fields.FieldSpec and loader.override_path("EXPERT_SLOTS") == "pool.expert_slots"
