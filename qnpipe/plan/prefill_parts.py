"""What a capacity costs in prefill parts: the extra layer passes a chunk's experts cause below their union (pure).

A layer-step whose experts do not fit the layer's slots runs in parts (qnpipe.policy.parts), each part a
pass of its own: a capacity below the union of a typical prefill chunk's experts splits every chunk. The
miss-ratio curves count the misses of those parts, not the passes; this module counts the passes, so the
allocation (qnpipe.plan.search) can price them.

Where the chunks come from:
- `log`: the log's own multi-token layer-steps (a traced run's prefill chunks), when it has any;
- `derived`: a log of one-token steps only (a decode log, `qnpipe trace synth`'s) has no chunk; its tokens,
  taken `forward.prefill_chunk_tokens` consecutive at a time at each layer (the whole log when 0), stand in
  for a prompt's chunks: a prompt as long as the log, routed as the log routes.
"""

from __future__ import annotations

from collections.abc import Sequence

from qnpipe.policy.parts import plan_parts_flat
from qnpipe.trace import ModelShape

Steps = Sequence[Sequence[tuple[int, tuple[int, ...]]]]


def chunks(steps: Steps, shape: ModelShape, chunk_tokens: int) -> tuple[dict[int, list[tuple[int, ...]]], str]:
    """Per MoE layer, the prefill chunks' experts (flat, token-major), and where they came from (module doc)."""
    k = shape.top_k
    multi: dict[int, list[tuple[int, ...]]] = {ly: [] for ly in shape.moe_layers}
    for step in steps:
        for ly, experts in step:
            if len(experts) > k and ly in multi:
                multi[ly].append(tuple(experts))
    if any(multi.values()):
        return multi, "log"
    per: dict[int, list[int]] = {ly: [] for ly in shape.moe_layers}
    for step in steps:
        for ly, experts in step:
            if ly in per:
                per[ly].extend(experts)
    out: dict[int, list[tuple[int, ...]]] = {}
    for ly, flat in per.items():
        width = (chunk_tokens or max(1, len(flat) // k)) * k
        out[ly] = [tuple(flat[i:i + width]) for i in range(0, len(flat), width) if len(flat[i:i + width]) > k]
    return out, "derived"


def extra_parts(chunk_experts: Sequence[tuple[int, ...]], k: int, num_experts: int) -> list[int]:
    """Passes beyond one per chunk at each capacity k..num_experts (index = capacity - k)."""
    out = [0] * (num_experts - k + 1)
    for flat in chunk_experts:
        union = len(set(flat))
        for c in range(k, min(union, num_experts + 1)):  # at the union and above: one part
            out[c - k] += len(plan_parts_flat(flat, k, c)) - 1
    return out


def layer_extra_parts(steps: Steps, shape: ModelShape, chunk_tokens: int) -> tuple[dict[int, list[int]], str]:
    """`extra_parts` of every MoE layer's chunks, and their source ("log" or "derived")."""
    per, source = chunks(steps, shape, chunk_tokens)
    return {ly: extra_parts(ch, shape.top_k, shape.num_experts) for ly, ch in per.items()}, source


__all__ = ["chunks", "extra_parts", "layer_extra_parts"]
