"""Routing logs of one MoE layer, one expert per step (top-1): a request stream as `qnpipe.replay` reads it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qnpipe import trace


def write_top1_log(path: Path, requests: Sequence[int], num_experts: int) -> None:
    """`requests[i]` is step i + 1's one expert at layer 0 of a one-layer model of `num_experts` experts."""
    shape = trace.ModelShape(num_layers=1, moe_layers=(0,), num_experts=num_experts, top_k=1, hidden_size=8)
    header = trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="top1", model=shape,
                          clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes", capacities={})
    w = trace.TraceWriter(path, header)
    for step, e in enumerate(requests, start=1):
        w.write(trace.Route(t=0.0, seq=step, step=step, layer=0, top_k=1, experts=(e,)))
    w.close(0, 0.0)
