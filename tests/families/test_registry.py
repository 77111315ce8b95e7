"""Every mlx-lm model file that builds a switch is tested or listed unsupported with a reason, and every
tiny config builds, has a switch and runs a forward to finite logits (float32).

The scan reads the installed mlx-lm, so an upgrade that adds a MoE family fails here until the family
gets a tiny config in qnpipe.model.family.tiny or a reason in qnpipe.model.family.registry.UNSUPPORTED.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.utils import MODEL_REMAPPING

from qnpipe.model.family import registry
from qnpipe.model.family.switches import find_switches
from qnpipe.model.family.tiny import CONFIGS, build_random

MODELS_DIR = Path(mlx_lm.__file__).resolve().parent / "models"
DOCS = Path(__file__).resolve().parents[2] / "docs"
BUILDS_A_SWITCH = re.compile(r"\bSwitch(GLU|MLP)\(")


def switch_modules(models_dir: Path = MODELS_DIR) -> dict[str, str]:
    """mlx-lm module name -> its source, for each model file that builds a SwitchGLU/SwitchMLP."""
    out = {}
    for f in sorted(models_dir.glob("*.py")):
        text = f.read_text()
        if f.stem != "switch_layers" and BUILDS_A_SWITCH.search(text):
            out[f.stem] = text
    return out


def unlisted(modules: Iterable[str], configs: Mapping[str, Mapping[str, object]],
             unsupported: Mapping[str, str]) -> list[str]:
    """The switch-building modules with neither a tiny config (by the module its model_type loads) nor
    an unsupported reason."""
    tested = {MODEL_REMAPPING.get(str(c["model_type"]), str(c["model_type"])) for c in configs.values()}
    return [f"{m}: builds a switch but has no tiny config and no reason in registry.UNSUPPORTED"
            for m in sorted(modules) if m not in tested and not unsupported.get(m, "").strip()]


def test_every_switch_family_is_tested_or_unsupported_with_a_reason() -> None:
    modules = switch_modules()
    assert len(modules) >= 40, sorted(modules)  # the scan sees mlx-lm's MoE files at all
    assert unlisted(modules, CONFIGS, registry.UNSUPPORTED) == []


def test_the_scan_fails_on_a_new_family(tmp_path: Path) -> None:
    (tmp_path / "made_up_moe.py").write_text("self.switch_mlp = SwitchGLU(d, h, n)\n")
    (tmp_path / "dense_thing.py").write_text("self.mlp = MLP(d, h)\n")
    assert list(switch_modules(tmp_path)) == ["made_up_moe"]
    assert unlisted(["made_up_moe"], CONFIGS, registry.UNSUPPORTED) == [
        "made_up_moe: builds a switch but has no tiny config and no reason in registry.UNSUPPORTED"]
    assert unlisted(["made_up_moe"], CONFIGS, {"made_up_moe": " "}) != []  # a blank reason is no reason
    assert unlisted(["made_up_moe"], CONFIGS, {"made_up_moe": "needs a Metal kernel"}) == []


def test_registry_lists_exactly_the_tiny_configs_and_real_modules() -> None:
    assert sorted(registry.TESTED) == sorted(CONFIGS)
    assert len(set(registry.TESTED)) == len(registry.TESTED)
    assert registry.TESTED[:len(registry.FIRST)] == registry.FIRST
    for m, why in registry.UNSUPPORTED.items():
        assert (MODELS_DIR / f"{m}.py").is_file(), m
        assert why.strip() and m not in CONFIGS
    assert set(registry.NO_PREDICTIONS) <= set(registry.TESTED)
    assert set(switch_modules()) - {"muse_spark"} >= {"deepseek", "kimi_k3", "mistral4"}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tiny_config_builds_and_runs(family: str) -> None:
    model = build_random(CONFIGS[family], seed=0)
    assert find_switches(model), f"{family}: no SwitchGLU/SwitchMLP found"
    logits = model(mx.array([[5, 17, 100, 200, 42, 7, 250, 3]]))
    assert logits.dtype == mx.float32
    assert np.isfinite(np.array(logits)).all()


def test_docs_table_is_the_registry() -> None:
    text = (DOCS / "model.md").read_text()
    begin, end = "<!-- families: begin (qnpipe.model.family.registry.family_table) -->", "<!-- families: end -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0].strip() == registry.family_table()
