"""Bad model directories are refused before any weight is read, with a CheckpointError naming the directory
and what is wrong: a model type mlx-lm does not know, a dense model (no switch), a config that names model
code of its own (`model_file`). Through the loading entry (build_skeleton, family_info) and `qnpipe convert`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest

from qnpipe.cli import main
from qnpipe.errors import CheckpointError
from qnpipe.model.family.skeleton import build_skeleton, family_info
from qnpipe.model.family.tiny import BASE, tiny_config

DENSE = {
    "llama": {**BASE, "model_type": "llama", "num_hidden_layers": 2},
    "qwen3": {**BASE, "model_type": "qwen3", "num_hidden_layers": 2},
}


def _load(config: dict[str, Any], where: str) -> Any:
    model = build_skeleton(config, {}, where)
    return family_info(config, model, where)


@pytest.mark.parametrize("dense", sorted(DENSE))
def test_a_dense_model_is_named(dense: str) -> None:
    with pytest.raises(CheckpointError, match=rf"^/models/{dense}: a {dense} model has no routed experts "
                       r"\(no SwitchGLU/SwitchMLP\): qnpipe streams the experts of MoE models only$"):
        _load(DENSE[dense], f"/models/{dense}")


def test_an_unknown_model_type_is_named() -> None:
    with pytest.raises(CheckpointError, match=r"^/models/x: model_type 'nosuch_moe' is not a model mlx-lm \S+ knows$"):
        _load(tiny_config("qwen3_moe", model_type="nosuch_moe"), "/models/x")
    with pytest.raises(CheckpointError, match=r"^/models/x: config.json has no model_type$"):
        _load({k: v for k, v in tiny_config("qwen3_moe").items() if k != "model_type"}, "/models/x")


def test_model_code_in_the_directory_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"^/models/x: config.json asks to import model code \('modeling.py'\); "
                       r"qnpipe runs mlx-lm's own model classes only$"):
        _load(tiny_config("qwen3_moe", model_file="modeling.py"), "/models/x")


def test_a_moe_model_passes() -> None:  # the control: the same entry accepts a MoE config
    info = _load(tiny_config("qwen3_moe"), "/models/x")
    assert (info.model_type, info.num_experts, info.moe_layers) == ("qwen3_moe", 16, (0, 2))


# --- through `qnpipe convert` -------------------------------------------------------------------------

def _save(d: Path, config: dict[str, Any]) -> Path:
    """An mlx-lm directory of `config` (random weights), as mlx-lm saves one."""
    from mlx_lm.utils import save_config, save_model

    from qnpipe.model.family.tiny import build_random

    save_model(d, build_random(config, seed=0))
    save_config(dict(config), d / "config.json")
    return d


def _refuse(*_: Any, **__: Any) -> NoReturn:
    raise AssertionError("a weight was read before the input was refused")


@pytest.mark.parametrize("case, edit, says", [
    ("dense", None, "a llama model has no routed experts"),
    ("unknown", {"model_type": "nosuch_moe"}, "model_type 'nosuch_moe' is not a model mlx-lm"),
    ("code", {"model_file": "modeling.py"}, "config.json asks to import model code ('modeling.py')"),
])
def test_convert_names_the_directory_and_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], case: str,
                                                      edit: dict[str, Any] | None, says: str) -> None:
    src = _save(tmp_path / case, DENSE["llama"] if edit is None else tiny_config("qwen3_moe"))
    if edit is not None:
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, **edit}))
    monkeypatch.setattr("qnpipe.convert.family.read_tensor", _refuse)
    monkeypatch.setattr("qnpipe.convert.plan.read_tensor", _refuse)
    assert main(["convert", str(src), "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and says in err, err
    assert not (tmp_path / "out").exists()
