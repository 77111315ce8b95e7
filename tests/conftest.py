"""Shared fixtures: tiny Qwen3-Next model directories made locally (nothing is downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import settings

from qnpipe import config
from qnpipe.compute import blas

# The user cache directory (qnpipe.config.user_dirs: the measured device profile a plan uses by default)
# is the session's own, for this process and every subprocess: tests never read or write the user's, and
# the one small first measurement is taken once per session, not per test.
_USER_CACHE = tempfile.mkdtemp(prefix="qnpipe-test-cache-")
os.environ["XDG_CACHE_HOME"] = _USER_CACHE
atexit.register(shutil.rmtree, _USER_CACHE, True)

# Before any test imports MLX: the suite runs on the BLAS of compute.cpu_blas (auto by default, so
# CI runs the exactness tests under OpenBLAS; QNPIPE_COMPUTE__CPU_BLAS=bundled runs them on MLX's own).
blas.apply(config.load().compute)

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE or `--hypothesis-profile NAME` (the option wins).
# ci: every property at its full count (a test's own count is a multiple of this one: tests/profiles.py).
# dev: a tenth, for the edit-run loop. No deadline in either: a per-example time limit is a wall-clock
# assert, and these run on 2 shared cores.
settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("dev", settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (docs/model.md, "Tiny test configuration") in the original HF layout, fp32."""
    from qnpipe.convert.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-hf", layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_mlx4(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    """`tiny_hf` converted by mlx-lm's own `convert` to 4-bit / group 64, bf16 scales."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("models") / "tiny-mlx4"
    convert(hf_path=str(tiny_hf), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    return out


@pytest.fixture(scope="session")
def tiny_mlx8(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    """`tiny_hf` converted by mlx-lm's own `convert` to 8-bit / group 64, bf16 scales."""
    import contextlib
    import io

    from mlx_lm import convert

    out = tmp_path_factory.mktemp("models") / "tiny-mlx8"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(hf_path=str(tiny_hf), mlx_path=str(out), quantize=True, q_bits=8, q_group_size=64, dtype="bfloat16")
    return out


@pytest.fixture(scope="session")
def tiny_qn4(tmp_path_factory: pytest.TempPathFactory, tiny_mlx4: Path, tiny_hf: Path) -> Path:
    """`tiny_mlx4` converted by `qnpipe convert` (MTP from `tiny_hf`): a qnpipe model directory. Read-only."""
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("models") / "tiny-qn4"
    convert(tiny_mlx4, out, mtp_from=tiny_hf)
    return out


@pytest.fixture(scope="session")
def trained_hf() -> Path:
    """The shipped trained tiny model: original HF layout, float32, every expert resident."""
    return Path(str(resources.files("qnpipe") / "data" / "tiny_trained"))


@pytest.fixture(scope="session")
def trained_qn4(tmp_path_factory: pytest.TempPathFactory, trained_hf: Path) -> Path:
    """`trained_hf` quantized to 4 bits / group 32 (experts and MTP head), as a qnpipe directory."""
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("models") / "trained-qn4"
    convert(trained_hf, out, bits=4, group_size=32, mtp_bits=4)
    return out
