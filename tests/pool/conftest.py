"""Streamed tiny models: qnpipe directories (an expert store) of several shapes, fp32 and 4-bit."""

from __future__ import annotations

from pathlib import Path

import pytest

SHAPES = {
    # 8 layers, 64 experts top-4 (the default tiny shape)
    "default": {},
    "3L-e16k2": {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2},
    "4L-e8k8": {"num_hidden_layers": 4, "full_attention_interval": 2, "num_experts": 8, "num_experts_per_tok": 8},
    "5L-e32k6": {"num_hidden_layers": 5, "full_attention_interval": 5, "num_experts": 32, "num_experts_per_tok": 6,
                 "moe_intermediate_size": 32, "hidden_size": 64},
}


@pytest.fixture(scope="session")
def streamed_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> qnpipe model directory: each shape in fp32, the default also 4-bit, the trained model in both."""
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("streamed")
    out: dict[str, Path] = {}
    for name, over in SHAPES.items():
        hf = make_tiny(root / f"{name}-hf", layout="hf", seed=3, config_overrides=over)
        convert(hf, root / f"{name}-fp32")
        out[f"{name}-fp32"] = root / f"{name}-fp32"
        if name == "default":
            convert(hf, root / f"{name}-4bit", bits=4, group_size=32)
            out[f"{name}-4bit"] = root / f"{name}-4bit"
    from qnpipe.cli import DEMO_MODEL_DIR as trained
    convert(trained, root / "trained-fp32")
    convert(trained, root / "trained-4bit", bits=4, group_size=32)
    out["trained-fp32"] = root / "trained-fp32"
    out["trained-4bit"] = root / "trained-4bit"
    return out
