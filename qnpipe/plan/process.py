"""The process outside MLX: what a run holds besides MLX's arrays and buffer cache, measured.

    nbytes, source = process_nbytes(cfg)   # plan.process_bytes when set, else measured here, once

The interpreter, the libraries the engine loads (MLX's own code, mlx-lm and the tokenizer's
transformers, trio, numpy), and their heaps: the resident set of this process less MLX's active
and cached memory (which the account's other lines hold), taken after importing what the engine
imports (`ENGINE_IMPORTS`), so a plan made before the model loads sees them; plus what a run adds
after start-up (`RUN_GROWTH_BYTES`, measured: the engine's objects, the tokenizer, MLX's first evaluations). The resident set is
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

# What a run adds to the process after start-up, beyond what MLX holds: the engine's objects (the model's
# modules, the reader and its threads, the actors' heaps), the tokenizer instance, MLX's first evaluations.
# Measured (tools/bench_plan.py --live's bench model, 2026-12-04, Linux CPU, mlx 0.x): VmRSS less MLX's active
# and cached memory after a 16-token generate is 24.3 MiB above the start-up figure (86.8 -> 111.1 MiB);
# the tokenizer is 3.4 MiB of it, MLX's first evaluations 2.8 MiB. Added to the measured line (a plan made
# before the model loads cannot see it); plan.process_bytes replaces both.
RUN_GROWTH_BYTES = 24 << 20

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


def high_water_bytes() -> int | None:
    """This process's resident high-water mark so far (`VmHWM`), None where /proc cannot tell."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_process() -> tuple[int, str]:
    """(bytes, source) of this process outside MLX, measured the first time and kept (module doc)."""
    global _measured
    if _measured is None:
        for name in ENGINE_IMPORTS:
            importlib.import_module(name)
        import mlx.core as mx

        rss, how = resident_bytes()
        held = mx.get_active_memory() + mx.get_cache_memory()
        _measured = (max(rss - held, 0) + RUN_GROWTH_BYTES,
                     f"measured in this process: {how} {fmt_bytes(rss)} less MLX's {fmt_bytes(held)}, after "
                     f"importing {', '.join(ENGINE_IMPORTS)}; plus {fmt_bytes(RUN_GROWTH_BYTES)} a run adds after "
                     f"start-up (qnpipe.plan.process.RUN_GROWTH_BYTES); plan.process_bytes sets it")
    return _measured


def adopt_measured(measured: tuple[int, str]) -> None:
    """Take `measured` (another process's `measure_process()`) as this process's figure: a child that plans
    for its parent accounts the parent's process, not its own (qnpipe.plan.child)."""
    global _measured
    _measured = (int(measured[0]), str(measured[1]))


def process_nbytes(cfg: Config) -> tuple[int, str]:
    """`plan.process_bytes` when set (non-zero), else this process measured (`measure_process`)."""
    if cfg.plan.process_bytes:
        return cfg.plan.process_bytes, "plan.process_bytes"
    return measure_process()


__all__ = ["ENGINE_IMPORTS", "RUN_GROWTH_BYTES", "adopt_measured", "high_water_bytes", "measure_process", "process_nbytes", "resident_bytes"]
