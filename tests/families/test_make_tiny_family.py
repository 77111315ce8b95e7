"""`qnpipe make-tiny --family`: a tiny random model of any tested family that mlx-lm itself loads and runs,
its logits equal to the in-memory model's, the same bytes for the same seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from qnpipe.cli import main
from qnpipe.convert.tiny import TOKENIZER_FILES, TOKENIZER_VOCAB_SIZE
from qnpipe.convert.tiny_family import family_config, make_tiny_family, quantize_as_mlx_lm, random_family_model
from qnpipe.model.family.registry import FIRST, TESTED
from qnpipe.model.family.skeleton import text_config

PROMPT = [5, 17, 300, 900, 42, 7, 1000, 3, 250, 64]


def _in_memory(family: str, seed: int, bits: int | None = None, mode: str = "affine") -> Any:
    config = family_config(family)
    model = random_family_model(config, seed)
    if bits is not None or mode != "affine":
        quantize_as_mlx_lm(model, config, bits, None, mode)
    return model


def _greedy(model: Any, n: int) -> tuple[list[int], list[np.ndarray]]:
    from mlx_lm.generate import generate_step

    toks, logprobs = [], []
    for (tok, lp), _ in zip(generate_step(mx.array(PROMPT), model, max_tokens=n), range(n), strict=False):
        toks.append(int(tok))
        logprobs.append(np.array(lp))
    return toks, logprobs


@pytest.mark.parametrize("family", TESTED)
def test_every_family_saves_and_mlx_lm_loads_it_equal(tmp_path: Path, family: str) -> None:
    from mlx_lm.utils import load_model

    d = make_tiny_family(tmp_path / family, family, seed=1)
    config = json.loads((d / "config.json").read_text())
    tc = text_config(config)
    assert tc.get("vocab_size", tc.get("num_vocab")) == TOKENIZER_VOCAB_SIZE
    assert "quantization" not in config
    assert all((d / f).is_file() for f in TOKENIZER_FILES)
    loaded, _ = load_model(d)
    toks = mx.array([PROMPT])
    assert np.array_equal(np.array(loaded(toks)), np.array(_in_memory(family, 1)(toks)))


@pytest.mark.parametrize("family, bits, mode", [
    *[(f, None, "affine") for f in FIRST], *[(f, 4, "affine") for f in FIRST], ("gpt_oss", None, "mxfp4")])
def test_mlx_lm_generates_from_it_as_from_the_model(tmp_path: Path, family: str, bits: int | None, mode: str) -> None:
    from mlx_lm.utils import load

    d = make_tiny_family(tmp_path / "m", family, bits=bits, mode=mode, seed=2)
    config = json.loads((d / "config.json").read_text())
    if bits is not None or mode != "affine":  # as mlx-lm's convert writes it
        want = {"group_size": 32, "bits": 4, "mode": mode}
        assert {k: config["quantization"][k] for k in want} == want
        assert config["quantization_config"] == config["quantization"]
    loaded, tokenizer = load(str(d))[:2]  # the committed tokenizer loads as the model's
    assert tokenizer.encode("def f(x):")
    got_toks, got_lp = _greedy(loaded, 6)
    want_toks, want_lp = _greedy(_in_memory(family, 2, bits, mode), 6)
    assert got_toks == want_toks
    assert all(np.array_equal(a, b) for a, b in zip(got_lp, want_lp, strict=True))


def test_the_cli_writes_the_same_bytes_for_the_same_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["make-tiny", str(a), "--family", "qwen3_moe", "--bits", "4", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(a)
    assert main(["make-tiny", str(b), "--family", "qwen3_moe", "--bits", "4", "--seed", "3"]) == 0
    assert main(["make-tiny", str(c), "--family", "qwen3_moe", "--bits", "4", "--seed", "4"]) == 0
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", *TOKENIZER_FILES} <= set(files)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert main(["make-tiny", str(a), "--family", "qwen3_moe"]) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err
    assert main(["make-tiny", str(a), "--family", "mixtral", "--force"]) == 0
    assert json.loads((a / "config.json").read_text())["model_type"] == "mixtral"


@pytest.mark.parametrize("argv, says", [
    (["--family", "qwen3_moe", "--layout", "hf"], "--family qwen3_moe writes mlx-lm's layout only"),
    (["--mode", "mxfp4"], "--mode needs --family"),
    (["--family", "gpt_oss", "--mode", "mxfp4", "--bits", "8"], "--mode mxfp4 is 4-bit with group size 32"),
    (["--family", "nosuch_moe"], "invalid choice: 'nosuch_moe'"),
])
def test_bad_options_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    try:
        rc = main(["make-tiny", str(tmp_path / "m"), *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = int(e.code or 0)
    assert rc == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_help_lists_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["make-tiny", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(f in out for f in TESTED)
    assert "Write a tiny Qwen3-Next" in out


@pytest.mark.parametrize("family, flags", [("qwen3_moe", ["--bits", "4"]), ("gpt_oss", ["--mode", "mxfp4"])])
def test_qnpipe_converts_what_make_tiny_wrote(tmp_path: Path, family: str, flags: list[str]) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    assert main(["make-tiny", str(src), "--family", family, *flags]) == 0
    assert main(["convert", str(src), "--out", str(out), "-q"]) == 0
    index = json.loads((out / "experts" / "index.json").read_text())
    assert index["family"]["model_type"] == family
