"""A small routing log for replay tests: 4 MoE layers, 16 experts, top-2, skewed routes, any subset of layers."""

from __future__ import annotations

import random
from pathlib import Path

from qnpipe import trace

NBYTES = 1 << 20  # the record size a routing log's replay is given
SHAPE = trace.ModelShape(num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=16, top_k=2, hidden_size=8)


def write_log(path: Path, layers: tuple[int, ...] = (0, 1, 2, 3), steps: int = 20) -> Path:
    """A routing log of `SHAPE` that routes through `layers` only."""
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="test", model=SHAPE,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes"))
    rng = random.Random(3)
    seq = 0
    for step in range(1, steps + 1):
        for layer in layers:
            w.write(trace.Route(t=0.0, seq=seq, step=step, layer=layer, top_k=2,
                                experts=tuple(rng.sample(range(step % 5, step % 5 + 6), 2))))
            seq += 1
    w.close(0, 0.0)
    return path
