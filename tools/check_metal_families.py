"""Run the Metal-only checks of the family seam on a Mac (they are skipped on CPU-only machines).

On Metal, `gather_qmm`/`gather_mm` choose their kernel and tiles from the expert stack's leading
dimension; the pool's stacks have its capacity, not the model's expert count. qnpipe hands the
kernels a view of the model's count (qnpipe/model/experts.py `expert_view`; docs/architecture.md,
"The family seam"). CPU kernels ignore that dimension, so only a Mac can show the fix holds.

On a Mac (Apple silicon, macOS 14+), from a checkout of qnpipe:

    python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'   # mlx with Metal, not mlx[cpu]
    .venv/bin/python tools/check_metal_families.py

It sweeps prefill lengths 1..256 at capacities {k, k+1, E/4, E/2, E} on tiny qwen3_moe (float32,
affine 4-bit) and gpt-oss (mxfp4) through the seam, and the native path's switch_glu, comparing
with mlx-lm bit for bit. Prefill steps split into parts (capacity below the step's experts) are
listed, not failed: their shapes differ from mlx-lm's by design. Exit status: pytest's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest


def main() -> int:
    if not mx.metal.is_available():
        print("Metal is not available here: these checks need a Mac with Apple silicon.", file=sys.stderr)
        return 2
    test = Path(__file__).resolve().parent.parent / "tests" / "families" / "test_seam_metal.py"
    return int(pytest.main([str(test), "-q", "-s", "-p", "no:randomly"]))


if __name__ == "__main__":
    sys.exit(main())
