"""The process outside MLX: what a run holds besides MLX's arrays and buffer cache, measured.

    nbytes, source = process_nbytes(cfg)   # plan.process_bytes when set, else measured here, once

The interpreter, the libraries the engine loads (MLX's own code, mlx-lm and the tokenizer's
transformers, trio, numpy), and their heaps: the resident set of this process less MLX's active
and cached memory (which the account's other lines hold), taken after importing what the engine
imports (`ENGINE_IMPORTS`), so a plan made before the model loads sees them. The resident set is
`VmRSS` of /proc/self/status on Linux; elsewhere (macOS) `resource.getrusage`'s `ru_maxrss`, this
process's high-water mark so far (bytes on macOS, KiB on Linux). Measured once per process (every
plan of one process shares the figure, so a budget's lines add up the same each time they are made).

It is this machine's process: planning for another (`--shape`, another machine's device profile),
set `plan.process_bytes` to that machine's figure (`tools/bench_plan.py --live` prints the peak
resident set and MLX's peak of a run: their difference).
"""

from __future__ import annotations

import importlib
import sys

from qnpipe.config import Config
from qnpipe.plan.units import fmt_bytes

# What a run imports before it generates: MLX, the model code (mlx-lm's too), the tokenizer
# (mlx_lm.tokenizer_utils loads transformers), the actors' trio.
ENGINE_IMPORTS = ("mlx.core", "mlx.nn", "qnpipe.model.load", "mlx_lm.tokenizer_utils", "trio")

_measured: tuple[int, str] | None = None


def resident_bytes() -> tuple[int, str]:
    """This process's resident set in bytes, and how it was read."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, "VmRSS"
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss"


def measure_process() -> tuple[int, str]:
    """(bytes, source) of this process outside MLX, measured the first time and kept (module doc)."""
    global _measured
    if _measured is None:
        for name in ENGINE_IMPORTS:
            importlib.import_module(name)
        import mlx.core as mx

        rss, how = resident_bytes()
        held = mx.get_active_memory() + mx.get_cache_memory()
        _measured = (max(rss - held, 0),
                     f"measured in this process: {how} {fmt_bytes(rss)} less MLX's {fmt_bytes(held)}, after "
                     f"importing {', '.join(ENGINE_IMPORTS)}; plan.process_bytes sets it")
    return _measured


def process_nbytes(cfg: Config) -> tuple[int, str]:
    """`plan.process_bytes` when set (non-zero), else this process measured (`measure_process`)."""
    if cfg.plan.process_bytes:
        return cfg.plan.process_bytes, "plan.process_bytes"
    return measure_process()


__all__ = ["ENGINE_IMPORTS", "measure_process", "process_nbytes", "resident_bytes"]
